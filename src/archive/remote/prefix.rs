//! A directory in object storage: the npy-dir under `s3://BUCKET/DIR/` (or an HTTP(S)
//! URL ending in `/`). Listing it gives every object's size and ETag at once, so each
//! file is pinned from the listing without a HEAD of its own; its objects then share
//! one client, one bound on parts in memory, one set of request slots and one set of
//! counters ([`Shared`]). A server that cannot list (plain HTTP: object_store lists
//! with WebDAV) still serves a directory whose files are named by its metadata, each
//! pinned by a HEAD when first opened.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use object_store::ObjectMeta;

use super::{
    client_for, head, invalid, one_line, parse, runtime, RemoteObject, Shared, IN_FLIGHT_DIR,
    PART_DIR, READAHEAD_MAX_DIR,
};
use crate::archive::ArchiveError;

pub struct RemotePrefix {
    shared: Arc<Shared>,
    /// The prefix's URL, ending in `/`, without credentials.
    display: String,
    /// The prefix's key (empty at a bucket's root), without the trailing `/`.
    prefix: String,
    /// Objects seen so far by their name under the prefix (`tensors/x__q.npy`), and the
    /// folders already listed ("" is the prefix itself).
    seen: Mutex<(HashMap<String, ObjectMeta>, HashSet<String>)>,
    /// Why the server cannot list, when it cannot.
    no_listing: Option<String>,
    /// Objects opened, by name: opening one again shares its parts and read-ahead.
    opened: Mutex<HashMap<String, RemoteObject>>,
    /// Held while listing, so the threads opening files list a folder once between them.
    listing: Mutex<()>,
}

impl RemotePrefix {
    /// Lists the prefix; an empty or unreachable one is an error.
    pub fn open(path: &Path) -> Result<RemotePrefix, ArchiveError> {
        let (url, display) = parse(path)?;
        let display = format!("{}/", display.trim_end_matches('/'));
        let (store, transient) = client_for(&url).map_err(|r| invalid(&display, r))?;
        let prefix = url.path().trim_matches('/').to_string();
        let http = url.scheme() != "s3";
        let mut p = RemotePrefix {
            shared: Arc::new(Shared::new(
                display.clone(),
                store,
                transient,
                IN_FLIGHT_DIR,
                PART_DIR,
                READAHEAD_MAX_DIR,
            )),
            display,
            prefix,
            seen: Mutex::new((HashMap::new(), HashSet::new())),
            no_listing: None,
            opened: Mutex::new(HashMap::new()),
            listing: Mutex::new(()),
        };
        match p.list("") {
            Ok(0) => return Err(invalid(&p.display, "no objects under this prefix")),
            Ok(_) => {}
            // Plain HTTP servers do not list: the directory's metadata names its files.
            Err(why) if http => p.no_listing = Some(why),
            Err(why) => return Err(invalid(&p.display, why)),
        }
        Ok(p)
    }

    /// The prefix's URL, ending in `/`.
    pub fn display(&self) -> &str {
        &self.display
    }

    /// The objects directly in folder `sub` ("" for the prefix itself) by name.
    pub fn names(&self, sub: &str) -> Result<Vec<String>, ArchiveError> {
        if let Some(why) = &self.no_listing {
            return Err(invalid(
                &self.display,
                format!("the server does not list folders ({why}); serve this directory over s3://, or write it with cawsfs (its cawsfs.json names every file)"),
            ));
        }
        self.list(sub)
            .map_err(|why| invalid(&format!("{}{sub}", self.display), why))?;
        let seen = self.seen.lock().unwrap();
        let lead = if sub.is_empty() {
            String::new()
        } else {
            format!("{sub}/")
        };
        let mut out: Vec<String> = seen
            .0
            .keys()
            .filter_map(|k| k.strip_prefix(&lead))
            .filter(|n| !n.is_empty() && !n.contains('/'))
            .map(str::to_string)
            .collect();
        out.sort();
        Ok(out)
    }

    /// The object `rel` names, as listed, or by a HEAD where the server cannot list.
    pub fn meta(&self, rel: &str) -> Option<ObjectMeta> {
        let folder = rel.rsplit_once('/').map_or("", |(d, _)| d);
        if self.no_listing.is_none() {
            self.list(folder).ok()?;
            return self.seen.lock().unwrap().0.get(rel).cloned();
        }
        if let Some(m) = self.seen.lock().unwrap().0.get(rel) {
            return Some(m.clone());
        }
        let m = head(&self.shared.store, &self.location(rel).ok()?).ok()?;
        self.seen
            .lock()
            .unwrap()
            .0
            .insert(rel.to_string(), m.clone());
        Some(m)
    }

    /// Open the object `rel` names, pinned as listed (once: later opens share it).
    pub fn open_object(&self, rel: &str) -> Result<RemoteObject, ArchiveError> {
        if let Some(o) = self.opened.lock().unwrap().get(rel) {
            return Ok(o.clone());
        }
        let shown = format!("{}{rel}", self.display);
        let meta = self
            .meta(rel)
            .ok_or_else(|| invalid(&shown, "no such object"))?;
        let o = RemoteObject::pinned(&self.shared, shown, meta);
        self.opened
            .lock()
            .unwrap()
            .insert(rel.to_string(), o.clone());
        Ok(o)
    }

    /// The counters of every object opened under the prefix.
    pub fn snapshot(&self) -> super::FetchSnapshot {
        self.shared.snapshot()
    }

    fn location(&self, rel: &str) -> Result<object_store::path::Path, String> {
        let key = if self.prefix.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        };
        object_store::path::Path::parse(key).map_err(|e| format!("bad object path: {e}"))
    }

    /// List folder `sub` once (every page); returns how many objects it holds.
    fn list(&self, sub: &str) -> Result<usize, String> {
        let _one_at_a_time = self.listing.lock().unwrap();
        if self.seen.lock().unwrap().1.contains(sub) {
            return Ok(0);
        }
        let at = if sub.is_empty() {
            object_store::path::Path::parse(&self.prefix)
        } else {
            object_store::path::Path::parse(format!("{}/{sub}", self.prefix))
        }
        .map_err(|e| format!("bad object path: {e}"))?;
        let store = &self.shared.store;
        let listed = runtime()
            .block_on(async { store.list_with_delimiter(Some(&at)).await })
            .map_err(|e| one_line(&e))?;
        let lead = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let mut seen = self.seen.lock().unwrap();
        let n = listed.objects.len();
        for m in listed.objects {
            if let Some(rel) = m.location.as_ref().strip_prefix(&lead) {
                seen.0.insert(rel.to_string(), m);
            }
        }
        seen.1.insert(sub.to_string());
        Ok(n)
    }
}
