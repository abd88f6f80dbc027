use super::*;

fn spec(size: u64) -> EntrySpec {
    EntrySpec {
        archive: 0x1234_5678_9abc_def0_1122_3344_5566_7788,
        file: "model.gguf".into(),
        size,
        extent: 4096,
        view: "gguf=auto".into(),
        layout: 0x0123_4567_89ab_cdef,
    }
}

fn extent_bytes(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

/// Extent `i`'s bytes as a mount offers them to the writer: a page-aligned chunk.
fn offered(i: u64, len: usize) -> crate::tier::ExtentBytes {
    let mut c = crate::cache::Chunk::zeroed(len);
    c.copy_from_slice(&extent_bytes(i, len));
    std::sync::Arc::new(c)
}

/// Size 3.5 extents: the last one is short.
const SIZE: u64 = 4096 * 3 + 2048;

fn fill(e: &Entry, which: &[u64]) {
    for &i in which {
        let len = e.extent_len(i).unwrap();
        e.write(i, &extent_bytes(i, len)).unwrap();
    }
}

#[test]
fn written_extents_are_served_only_after_publish_and_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (e, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(found, Found::New);
    fill(&e, &[0, 3]);
    let mut buf = vec![0u8; 4096];
    // Written but not published: not served (a crash here must not serve it).
    assert!(!e.read(0, &mut buf).unwrap());
    assert!(e.is_dirty());
    e.publish().unwrap();
    assert!(!e.is_dirty());
    assert!(e.read(0, &mut buf).unwrap());
    assert_eq!(buf, extent_bytes(0, 4096));
    assert!(!e.read(1, &mut buf).unwrap());
    assert_eq!(e.present_bytes(), 4096 + 2048);
    drop(e);

    let (e, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(found, Found::Existing(2));
    let mut last = vec![0u8; 2048];
    assert!(e.read(3, &mut last).unwrap());
    assert_eq!(last, extent_bytes(3, 2048));
    assert!(!e.is_whole());
    fill(&e, &[1, 2]);
    e.publish().unwrap();
    assert!(e.is_whole());
    assert!(e.verify_all().unwrap().is_empty());
    // The data file holds the virtual file's bytes at their offsets.
    let data = std::fs::read(e.data_path()).unwrap();
    let want: Vec<u8> = (0..4)
        .flat_map(|i| extent_bytes(i, e.extent_len(i).unwrap()))
        .collect();
    assert_eq!(data, want);
}

#[test]
fn a_changed_extent_is_dropped_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1, 2, 3]);
    e.publish().unwrap();
    let path = e.data_path().to_path_buf();
    drop(e);
    // Flip one byte of extent 2.
    let mut data = std::fs::read(&path).unwrap();
    data[2 * 4096 + 17] ^= 0x40;
    std::fs::write(&path, &data).unwrap();

    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert!(e.is_whole());
    let mut buf = vec![0u8; 4096];
    assert!(!e.read(2, &mut buf).unwrap());
    assert!(!e.has(2) && !e.is_whole());
    assert!(e.read(1, &mut buf).unwrap());
    // The drop reaches the index at the next publish; reopened, 2 stays absent.
    assert!(e.is_dirty());
    e.publish().unwrap();
    drop(e);
    let (e, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(found, Found::Existing(3));
    assert!(!e.has(2));
}

#[test]
fn verify_all_finds_every_bad_extent() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1, 2, 3]);
    e.publish().unwrap();
    let f = OpenOptions::new().write(true).open(e.data_path()).unwrap();
    f.write_all_at(&[0xff; 3], 4096 * 3 + 100).unwrap();
    f.write_all_at(&[0xee; 1], 5).unwrap();
    assert_eq!(e.verify_all().unwrap(), vec![0, 3]);
    assert!(!e.is_whole());
}

/// A clean full check leaves a stamp that spares the next one only while neither file
/// has changed: a byte written into the data file afterwards is still found, even by
/// a later process that reopens the entry.
#[test]
fn verification_is_skipped_only_for_unchanged_files() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1, 2, 3]);
    e.publish().unwrap();
    let stamp = e.idx_path.with_extension("ok");
    // Files changed a moment ago are checked but not stamped: a write in the same tick
    // of the file system's clock would not move their change time.
    assert_eq!(e.verify_all_once().unwrap(), Vec::<u64>::new());
    assert!(!stamp.exists());
    std::thread::sleep(std::time::Duration::from_millis(150));
    assert_eq!(e.verify_all_once().unwrap(), Vec::<u64>::new());
    assert!(stamp.exists());
    drop(e);
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(e.verify_all_once().unwrap(), Vec::<u64>::new());
    // The change time moves with any write, even one that restores the mtime.
    let f = OpenOptions::new().write(true).open(e.data_path()).unwrap();
    let mtime = f.metadata().unwrap().modified().unwrap();
    f.write_all_at(&[0xee; 1], 4096 * 2 + 7).unwrap();
    f.set_modified(mtime).unwrap();
    drop((f, e));
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(e.verify_all_once().unwrap(), vec![2]);
    // Extents waiting for their index are never vouched for.
    e.write(2, &extent_bytes(2, 4096)).unwrap();
    assert!(e.stamp().is_none());
}

/// An entry this process made whole from its own writes is stamped without being read
/// back (its next mount's first passthrough open does not read it whole first); one
/// with extents from an earlier process, or a file changed since, is not vouched for.
#[test]
fn only_an_entry_written_whole_here_and_unchanged_is_stamped_unread() {
    let settle = || std::thread::sleep(std::time::Duration::from_millis(150));
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1, 2, 3]);
    e.publish().unwrap();
    let stamp = e.idx_path.with_extension("ok");
    assert!(
        e.stamp_vouched().is_some(),
        "files changed a moment ago wait"
    );
    settle();
    assert_eq!(e.stamp_vouched(), None);
    assert!(stamp.exists());
    drop(e);
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(e.verify_all_once().unwrap(), Vec::<u64>::new());

    // Half written by an earlier process: not vouched for until read and checked.
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1]);
    e.publish().unwrap();
    drop(e);
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[2, 3]);
    e.publish().unwrap();
    settle();
    assert_eq!(e.stamp_vouched(), None);
    assert!(!e.idx_path.with_extension("ok").exists());
    // A byte changed under the earlier half is found by the full check that follows.
    let f = OpenOptions::new().write(true).open(e.data_path()).unwrap();
    f.write_all_at(&[0xee; 1], 7).unwrap();
    drop(f);
    assert_eq!(e.verify_all_once().unwrap(), vec![0]);

    // Written whole here, then changed by someone else: checked in full, in this
    // process too.
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1, 2, 3]);
    e.publish().unwrap();
    let f = OpenOptions::new().write(true).open(e.data_path()).unwrap();
    f.write_all_at(&[0xee; 1], 4096 + 7).unwrap();
    drop(f);
    assert_eq!(e.verify_all_once().unwrap(), vec![1]);
    settle();
    assert_eq!(e.stamp_vouched(), None);
    assert!(!e.idx_path.with_extension("ok").exists());
}

#[test]
fn a_damaged_or_foreign_index_is_dropped_with_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1]);
    e.publish().unwrap();
    let idx = e.idx_path.clone();
    drop(e);
    let good = std::fs::read(&idx).unwrap();

    // Every single-byte change of the index is caught (magic, fields, sums, checksum).
    for at in 0..good.len() {
        let mut bad = good.clone();
        bad[at] ^= 0x01;
        std::fs::write(&idx, &bad).unwrap();
        let (e, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
        assert!(matches!(found, Found::Dropped(_)), "byte {at}: {found:?}");
        assert!(!e.has(0) && !e.has(1));
        drop(e);
        std::fs::write(&idx, &good).unwrap();
    }
    // Truncated, and empty.
    for len in [0, 7, HEADER, good.len() - 1] {
        std::fs::write(&idx, &good[..len]).unwrap();
        let (_, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
        assert!(
            matches!(found, Found::Dropped(_)),
            "length {len}: {found:?}"
        );
        std::fs::write(&idx, &good).unwrap();
    }
    // The same index under another spec's key (a renamed file): refused.
    let other = EntrySpec {
        view: "gguf=q8_0".into(),
        ..spec(SIZE)
    };
    std::fs::write(dir.path().join(format!("{:032x}.idx", other.key())), &good).unwrap();
    let (_, found) = Entry::open(dir.path(), other).unwrap();
    assert!(
        matches!(found, Found::Dropped(ref why) if why.contains("another file")),
        "{found:?}"
    );
}

#[test]
fn a_half_written_index_is_never_used() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0]);
    e.publish().unwrap();
    // A crash mid-publish leaves the temporary file: the published index still rules.
    std::fs::write(e.idx_path.with_extension("idx.tmp"), b"CAWSTIER partial").unwrap();
    drop(e);
    let (e, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(found, Found::Existing(1));
    assert!(e.has(0));
}

#[test]
fn keys_differ_by_every_field() {
    let base = spec(SIZE);
    let variants = [
        EntrySpec {
            archive: base.archive ^ 1,
            ..base.clone()
        },
        EntrySpec {
            file: "model.safetensors".into(),
            ..base.clone()
        },
        EntrySpec {
            size: SIZE + 1,
            ..base.clone()
        },
        EntrySpec {
            extent: 8192,
            ..base.clone()
        },
        EntrySpec {
            view: "gguf=f16".into(),
            ..base.clone()
        },
        EntrySpec {
            layout: base.layout ^ 1,
            ..base.clone()
        },
    ];
    for v in &variants {
        assert_ne!(v.key(), base.key(), "{v:?}");
    }
}

#[test]
fn bad_extent_numbers_and_lengths_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert!(matches!(
        e.write(4, &[0; 10]),
        Err(TierError::NoExtent { .. })
    ));
    assert!(matches!(
        e.write(3, &[0; 4096]),
        Err(TierError::ExtentLen { .. })
    ));
    let mut buf = vec![0u8; 100];
    assert!(matches!(
        e.read(0, &mut buf),
        Err(TierError::ExtentLen { .. })
    ));
}

#[test]
fn gc_removes_least_recently_used_entries_down_to_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let big = 1 << 20;
    let mut keys = Vec::new();
    for (n, name) in ["a", "b", "c"].iter().enumerate() {
        let s = EntrySpec {
            file: name.to_string(),
            size: big,
            extent: big,
            ..spec(0)
        };
        let (e, _) = Entry::open(dir.path(), s).unwrap();
        e.write(0, &vec![n as u8 + 1; big as usize]).unwrap();
        e.publish().unwrap();
        keys.push(e.key());
        // Distinct last-use times.
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let listed = list(dir.path()).unwrap();
    assert_eq!(listed.len(), 3);
    assert!(listed
        .iter()
        .all(|e| e.whole && e.size == big && e.disk_bytes >= big));
    // Room for about two: the oldest ("a") goes, unless kept; then "b".
    let done = gc(dir.path(), 2 * big + big / 2, &[keys[0]]).unwrap();
    let removed: Vec<_> = done.removed.iter().map(|e| e.key.clone()).collect();
    assert_eq!(removed, vec![format!("{:032x}", keys[1])]);
    assert!(done.busy.is_empty() && done.left_bytes >= 2 * big);
    let left: Vec<String> = list(dir.path())
        .unwrap()
        .into_iter()
        .map(|e| e.key)
        .collect();
    assert_eq!(left.len(), 2);
    assert!(!dir.path().join(format!("{:032x}.data", keys[1])).exists());
    assert!(clear(dir.path()).unwrap().removed.len() == 2);
    assert!(list(dir.path()).unwrap().is_empty());
}

#[test]
fn gc_and_clear_leave_entries_a_mount_has_open() {
    let dir = tempfile::tempdir().unwrap();
    let (open, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&open, &[0, 1]);
    open.publish().unwrap();
    let closed_spec = EntrySpec {
        file: "model.safetensors".into(),
        ..spec(SIZE)
    };
    {
        let (closed, _) = Entry::open(dir.path(), closed_spec.clone()).unwrap();
        fill(&closed, &[0]);
        closed.publish().unwrap();
    }
    // Written but never published: still listed, so that it can be reclaimed.
    let (unpublished, _) = Entry::open(
        dir.path(),
        EntrySpec {
            file: "config.json".into(),
            ..spec(SIZE)
        },
    )
    .unwrap();
    unpublished.write(0, &extent_bytes(0, 4096)).unwrap();
    let key = unpublished.key();
    drop(unpublished);
    let listed = list(dir.path()).unwrap();
    assert_eq!(listed.len(), 3);
    let in_use: Vec<_> = listed.iter().filter(|e| e.in_use).map(|e| &e.key).collect();
    assert_eq!(in_use, vec![&format!("{:032x}", open.key())]);

    let done = clear(dir.path()).unwrap();
    assert_eq!((done.removed.len(), done.busy.len()), (2, 1));
    assert!(!dir.path().join(format!("{key:032x}.data")).exists());
    // The open entry still serves what it holds.
    let mut buf = vec![0u8; 4096];
    assert!(open.read(1, &mut buf).unwrap());
    assert_eq!(buf, extent_bytes(1, 4096));
    drop(open);
    assert_eq!(clear(dir.path()).unwrap().removed.len(), 1);
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
    // A cleared entry opens empty.
    let (again, found) = Entry::open(dir.path(), closed_spec).unwrap();
    assert_eq!((found, again.present_bytes()), (Found::New, 0));
}

#[test]
fn a_data_file_of_the_wrong_size_is_not_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1, 2, 3]);
    e.publish().unwrap();
    let path = e.data_path().to_path_buf();
    drop(e);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(4096).unwrap();
    drop(f);
    let (e, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert!(
        matches!(found, Found::Dropped(ref why) if why.contains("4096 bytes")),
        "{found:?}"
    );
    assert!((0..4).all(|i| !e.has(i)));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), SIZE);
}

#[test]
fn the_writer_writes_publishes_on_flush_and_keeps_its_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    let e = std::sync::Arc::new(e);
    // Room for three full extents on disk, with what the bound charges for their map.
    let w = Writer::start(1 << 20, 3 * crate::tier::disk_charge(4096)).unwrap();
    for i in 0..3 {
        assert!(w.offer(&e, i, offered(i, 4096)));
    }
    // The fourth (2 KiB) no longer fits the bound: not queued, counted.
    assert!(!w.offer(&e, 3, offered(3, 2048)));
    w.flush();
    let s = w.stats();
    assert_eq!((s.written_extents, s.written_bytes), (3, 3 * 4096));
    assert_eq!(
        (s.over_bound_extents, s.dropped_extents, s.errors),
        (1, 0, 0)
    );
    assert!((0..3).all(|i| e.has(i)) && !e.has(3));
    drop(w);
    // Published for good: a reopened entry lists them.
    let (again, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(found, Found::Existing(3));
    let mut buf = vec![0u8; 4096];
    assert!(again.read(2, &mut buf).unwrap());
    assert_eq!(buf, extent_bytes(2, 4096));

    // A queue smaller than one extent takes nothing, and says so.
    let w = Writer::start(1000, 1 << 30).unwrap();
    assert!(!w.offer(&e, 3, offered(3, 2048)));
    assert_eq!(w.stats().dropped_extents, 1);
    // The dropped extent is handed out (once) for a refill, which may wait for room.
    let dropped = w.take_dropped_when_idle();
    assert_eq!(dropped.len(), 1);
    assert!(std::sync::Arc::ptr_eq(&dropped[0].0, &e) && dropped[0].1 == 3);
    assert!(w.take_dropped_when_idle().is_empty());
    assert!(w.offer_wait(&e, 3, offered(3, 2048)));
    w.flush();
    assert!(e.has(3));
}

#[test]
fn direct_and_buffered_writes_of_one_extent_agree_with_what_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    // Buffered first (an unaligned address), then read so the page cache holds it.
    let old = extent_bytes(0, 4097);
    e.write(0, &old[1..]).unwrap();
    e.publish().unwrap();
    assert_eq!(std::fs::read(e.data_path()).unwrap()[..4096], old[1..]);
    // The same extent again from a page-aligned buffer: past the page cache where the
    // file system takes O_DIRECT. Readers must see the new bytes, not cached old ones.
    let mut aligned = memmap2::MmapMut::map_anon(4096).unwrap();
    aligned.copy_from_slice(&extent_bytes(9, 4096));
    e.write(0, &aligned).unwrap();
    e.publish().unwrap();
    // Where the file could be opened O_DIRECT, the aligned write used it.
    assert_eq!(
        e.direct_works.load(Ordering::Relaxed),
        e.direct.is_some(),
        "an aligned direct write was refused"
    );
    let mut buf = vec![0u8; 4096];
    assert!(e.read(0, &mut buf).unwrap());
    assert_eq!(buf, extent_bytes(9, 4096));
    assert_eq!(std::fs::read(e.data_path()).unwrap()[..4096], buf[..]);
    // The short last extent is written buffered whatever its buffer.
    fill(&e, &[3]);
    e.publish().unwrap();
    let mut last = vec![0u8; 2048];
    assert!(e.read(3, &mut last).unwrap());
    assert_eq!(last, extent_bytes(3, 2048));
}

#[test]
fn a_run_of_extents_is_written_in_place_and_listed_after_publish() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    let mut maps: Vec<memmap2::MmapMut> = (0..3)
        .map(|_| memmap2::MmapMut::map_anon(4096).unwrap())
        .collect();
    for (i, m) in maps.iter_mut().enumerate() {
        m.copy_from_slice(&extent_bytes(i as u64 + 1, 4096));
    }
    // Extents 1..3: 1 and 2 exist, 3 is the short last one (2 KiB): refused whole.
    let bufs: Vec<&[u8]> = maps.iter().map(|m| &m[..]).collect();
    assert!(matches!(
        e.write_run(1, &bufs),
        Err(TierError::ExtentLen { extent: 3, .. })
    ));
    e.write_run(1, &bufs[..2]).unwrap();
    assert!(!e.has(1));
    e.publish().unwrap();
    let mut buf = vec![0u8; 4096];
    for i in 1..3 {
        assert!(e.read(i, &mut buf).unwrap());
        assert_eq!(buf, extent_bytes(i, 4096));
    }
    assert!(!e.has(0) && !e.has(3));
}

/// Runs `f` on a thread and fails the test if it has not returned within 10 s: what
/// lies in a tier directory must never make an open or a listing block.
fn within_10s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(10))
        .unwrap_or_else(|_| panic!("{what} blocked"))
}

fn mkfifo(p: &Path) {
    nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
}

/// Every name of an entry replaced by a FIFO, a link to a victim file, a link to
/// /dev/zero and a directory (issue 58, lines 1, 4, 5, 6): opening never blocks,
/// never writes through a link, never reads a device, and the entry starts again.
#[test]
fn names_that_are_not_regular_files_are_removed_never_followed() {
    type Plant = fn(&Path, &Path);
    let plants: [(&str, Plant); 4] = [
        ("fifo", |p, _| mkfifo(p)),
        ("link to a file", |p, victim| {
            std::os::unix::fs::symlink(victim, p).unwrap()
        }),
        ("link to /dev/zero", |p, _| {
            std::os::unix::fs::symlink("/dev/zero", p).unwrap()
        }),
        ("directory", |p, _| std::fs::create_dir(p).unwrap()),
    ];
    for ext in ["data", "idx", "ok", "json"] {
        for (what, plant) in plants {
            let dir = tempfile::tempdir().unwrap();
            let victim = dir.path().join("victim");
            std::fs::write(&victim, b"not yours").unwrap();
            let t = dir.path().join("t");
            open_dir(&t).unwrap();
            {
                let (e, _) = Entry::open(&t, spec(SIZE)).unwrap();
                fill(&e, &[0, 1, 2, 3]);
                e.publish().unwrap();
                assert!(e.verify_all_once().unwrap().is_empty());
                write_label(&e, &Label::default());
            }
            let key = format!("{:032x}", spec(SIZE).key());
            let p = t.join(format!("{key}.{ext}"));
            let _ = std::fs::remove_file(&p);
            plant(&p, &victim);
            let t2 = t.clone();
            let (e, found) = within_10s(what, move || Entry::open(&t2, spec(SIZE)).unwrap());
            // A damaged data file or index starts the entry again; a stamp or label
            // that is not a file is only ignored.
            match ext {
                "data" | "idx" => assert!(
                    matches!(found, Found::Dropped(_)),
                    "{ext} {what}: {found:?}"
                ),
                _ => assert_eq!(found, Found::Existing(4), "{ext} {what}"),
            }
            let e = std::sync::Arc::new(e);
            let e2 = e.clone();
            let bad = within_10s(what, move || e2.verify_all_once().unwrap());
            assert!(bad.is_empty(), "{ext} {what}: {bad:?}");
            fill(&e, &[0, 1, 2, 3]);
            e.publish().unwrap();
            let mut buf = vec![0u8; 4096];
            assert!(e.read(1, &mut buf).unwrap(), "{ext} {what}");
            assert_eq!(buf, extent_bytes(1, 4096));
            assert_eq!(
                std::fs::read(&victim).unwrap(),
                b"not yours",
                "{ext} {what}"
            );
            drop(e);
            let t2 = t.clone();
            within_10s(what, move || list(&t2).unwrap());
        }
    }
}

/// FIFOs, links and directories named like entries (issue 58, lines 2 and 6):
/// `tier ls`, `gc` and `clear` finish, remove the names without following them, and
/// report a directory they cannot remove instead of failing.
#[test]
fn listing_and_clearing_survive_whatever_is_named_like_an_entry() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t");
    open_dir(&t).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"not yours").unwrap();
    let hex = |i: u8| format!("{:032x}", 0xabcdef00u128 + u128::from(i));
    mkfifo(&t.join(format!("{}.data", hex(1))));
    mkfifo(&t.join(format!("{}.idx", hex(2))));
    mkfifo(&t.join(format!("{}.json", hex(2))));
    std::os::unix::fs::symlink(&victim, t.join(format!("{}.data", hex(3)))).unwrap();
    std::os::unix::fs::symlink("/dev/zero", t.join(format!("{}.idx", hex(4)))).unwrap();
    std::fs::create_dir(t.join(format!("{}.data", hex(5)))).unwrap();
    std::fs::create_dir_all(t.join(format!("{}.data/inside", hex(6)))).unwrap();
    let t2 = t.clone();
    let listed = within_10s("tier ls", move || list(&t2).unwrap());
    assert_eq!(listed.len(), 6);
    assert!(listed.iter().all(|e| !e.in_use && e.disk_bytes == 0));
    let t2 = t.clone();
    let done = within_10s("tier clear", move || clear(&t2).unwrap());
    assert_eq!((done.removed.len(), done.failed.len()), (5, 1), "{done:?}");
    assert!(
        done.failed[0].1.contains("a directory"),
        "{:?}",
        done.failed
    );
    let left: Vec<_> = std::fs::read_dir(&t)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, [format!("{}.data", hex(6))]);
    assert_eq!(std::fs::read(&victim).unwrap(), b"not yours");
}

/// The tier directory itself (issue 58, line 6): one clear line for each kind of
/// unusable path, and none that others can write.
#[test]
fn an_unusable_tier_directory_is_named_and_explained() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, b"").unwrap();
    let dangling = dir.path().join("dangling");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
    let open_one = dir.path().join("open");
    std::fs::create_dir(&open_one).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&open_one, std::fs::Permissions::from_mode(0o777)).unwrap();
    for (p, says) in [
        (file.as_path(), "a regular file, not a directory"),
        (dangling.as_path(), "dangling symbolic link"),
        (
            Path::new("/dev/null"),
            "a character device, not a directory",
        ),
        (open_one.as_path(), "writable by others"),
    ] {
        let e = open_dir(p).unwrap_err().to_string();
        assert!(
            e.starts_with("disk tier directory ") && e.contains(says),
            "{e}"
        );
        assert!(e.contains(&p.display().to_string()), "{e}");
        assert!(list(p).is_err() || !p.exists(), "{p:?}");
    }
}

/// An index of absurd size is not read whole (issue 58, line 5).
#[test]
fn an_oversized_index_is_dropped_unread() {
    let dir = tempfile::tempdir().unwrap();
    let key = spec(SIZE).key();
    let idx = dir.path().join(format!("{key:032x}.idx"));
    // Sparse: 64 GiB on paper, nothing on disk.
    std::fs::File::create(&idx)
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let (_, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert!(
        matches!(found, Found::Dropped(ref why) if why.contains("more than")),
        "{found:?}"
    );
}

/// A sealed data file cannot be written, truncated or removed, root included; another
/// opener uses it read-only; the last user lifts the seal; a seal left by a process
/// that died is lifted by the next opener; a lifted seal is seen (issue 58, line 3).
#[test]
fn a_sealed_entry_cannot_change_and_the_last_user_lifts_the_seal() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1, 2, 3]);
    e.publish().unwrap();
    assert!(
        e.seal().unwrap(),
        "the immutable flag is not available here"
    );
    let path = e.data_path().to_path_buf();
    let err = OpenOptions::new().write(true).open(&path).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    assert!(std::fs::remove_file(&path).is_err());
    assert!(e.seal_holds());
    // A second mount of the same entry: read-only, serving, not writing.
    let (other, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(found, Found::Existing(4));
    let mut buf = vec![0u8; 4096];
    assert!(other.read(2, &mut buf).unwrap());
    assert!(matches!(
        other.write(0, &buf),
        Err(TierError::Sealed { .. })
    ));
    // Two users: the first to leave keeps the seal for the other.
    assert!(e.unseal().is_none());
    assert!(localfs::is_immutable(e.data_file()));
    drop(e);
    assert!(other.seal().unwrap());
    let after = other.unseal().expect("the last user lifts an intact seal");
    assert!(!localfs::is_immutable(other.data_file()));
    std::thread::sleep(SETTLED);
    other.restamp(&after);
    assert!(other.verify_all_once().unwrap().is_empty());
    drop(other);

    // A seal lifted by someone else is seen, once.
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert!(e.seal().unwrap());
    let f = std::fs::File::open(&path).unwrap();
    localfs::set_immutable(&f, false).unwrap();
    assert!(!e.seal_holds());
    assert!(e.seal_broken());
    assert!(!e.seal_broken());
    // A process that dies with its entry sealed: the next opener lifts the seal.
    assert!(e.seal().unwrap());
    drop(e);
    assert!(localfs::is_immutable(&f));
    let (e, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(found, Found::Existing(4));
    assert!(!localfs::is_immutable(&f));
    e.write(0, &extent_bytes(0, 4096)).unwrap();
    // And `clear` lifts a stale seal before removing.
    assert!(e.seal().unwrap());
    drop(e);
    assert_eq!(clear(dir.path()).unwrap().removed.len(), 1);
    assert!(!path.exists());
}

/// A publish that fails (here: a directory where the index goes; a full disk alike)
/// leaves the entry to publish again, without new writes, and no temporary behind
/// (issue 58, line 7).
#[test]
fn a_failed_publish_is_retried_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    let e = std::sync::Arc::new(e);
    let idx = dir.path().join(format!("{:032x}.idx", e.key()));
    std::fs::create_dir_all(idx.join("in-the-way")).unwrap();
    let w = Writer::start(1 << 20, 1 << 30).unwrap();
    for i in 0..4 {
        let len = e.extent_len(i).unwrap();
        assert!(w.offer_wait(&e, i, offered(i, len)));
    }
    w.flush();
    assert!(w.stats().errors >= 1);
    assert!(e.is_dirty());
    let tmp: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|x| x.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(tmp.is_empty(), "{tmp:?}");
    std::fs::remove_dir_all(&idx).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !idx.is_file() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(idx.is_file(), "the index was not published again");
    drop(w);
    let key = e.key();
    drop(e);
    let (_, found) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    assert_eq!(found, Found::Existing(4), "{key:032x}");
}

/// A write past a lifted seal is reported by the watcher without any open (issue 58,
/// line 3). Lifting the flag alone raises no event here.
#[test]
fn the_watcher_reports_a_write_past_the_seal() {
    let dir = tempfile::tempdir().unwrap();
    let (e, _) = Entry::open(dir.path(), spec(SIZE)).unwrap();
    fill(&e, &[0, 1, 2, 3]);
    e.publish().unwrap();
    assert!(e.seal().unwrap());
    let w = SealWatch::new().unwrap();
    w.watch(&e, 7).unwrap();
    assert!(w.changed(std::time::Duration::from_millis(50)).is_empty());
    let f = OpenOptions::new().write(true).open(e.data_path());
    assert!(f.is_err(), "sealed, yet open for writing");
    let f = std::fs::File::open(e.data_path()).unwrap();
    localfs::set_immutable(&f, false).unwrap();
    assert!(!e.seal_holds());
    let f = OpenOptions::new().write(true).open(e.data_path()).unwrap();
    f.write_all_at(b"x", 100).unwrap();
    assert_eq!(w.changed(std::time::Duration::from_secs(5)), [7]);
}
