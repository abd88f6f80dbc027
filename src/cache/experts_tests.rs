//! Unit tests of the expert predictor (experts.rs).

use super::*;

const EXPERT: u64 = 1000;

/// `layers` layers of `experts` experts, each one extent of EXPERT bytes, laid out
/// layer by layer from byte 0.
fn map(layers: u32, experts: u32, used: u32) -> ExpertMap {
    let ext = (0..layers).flat_map(|l| {
        (0..experts).map(move |e| {
            let at = u64::from(l * experts + e) * EXPERT;
            (l, e, at..at + EXPERT)
        })
    });
    ExpertMap::new(experts, used, ext).unwrap()
}

fn at(m: &ExpertMap, l: u32, e: u32) -> u64 {
    u64::from(l * m.experts + e) * EXPERT
}

/// One token through every layer: expert `route(l)` of each.
fn token(p: &Predictor, route: impl Fn(u32) -> u32) -> Vec<Vec<Range<u64>>> {
    (0..p.map.layers)
        .map(|l| obs(p, at(&p.map, l, route(l)) + 10, 300))
        .collect()
}

/// A read that starts a run of its own.
fn obs(p: &Predictor, offset: u64, len: u64) -> Vec<Range<u64>> {
    p.observe(offset, offset, len)
}

fn stats(p: &Predictor) -> ExpertStats {
    let mut s = ExpertStats::default();
    p.add_stats(&mut s);
    s.finish();
    s
}

#[test]
fn map_finds_units_and_refuses_what_cannot_be() {
    let m = map(2, 4, 2);
    assert_eq!(m.unit_at(0), Some(0));
    assert_eq!(m.unit_at(EXPERT * 5 + 3), Some(5));
    assert_eq!(m.unit_at(EXPERT * 8), None);
    let over = ExpertMap::new(2, 2, [(0, 0, 0..10), (0, 1, 5..20)]);
    assert!(over.unwrap_err().contains("overlap"));
    let big = ExpertMap::new(1 << 12, 2, [(1, 0, 0..10)]);
    assert!(big.unwrap_err().contains("transition counts"));
    let bad = ExpertMap::new(2, 2, [(0, 2, 0..10)]);
    assert!(bad.unwrap_err().contains("not below 2"));
    assert!(ExpertMap::new(2, 2, []).is_err());
}

#[test]
fn reads_at_the_edges_of_experts_are_not_routing() {
    // Experts of 8 MiB: a read counts once a step has read 2 MiB of an expert, or
    // a run from before it has gone 2 MiB into it.
    let big = 8u64 << 20;
    let ext = (0..3u32).flat_map(|l| {
        (0..4u32).map(move |e| {
            let at = u64::from(l * 4 + e) * big;
            (l, e, at..at + big)
        })
    });
    let p = Predictor::new(ExpertMap::new(4, 1, ext).unwrap(), ExpertMode::Learn);
    let x = |l: u32, e: u32| u64::from(l * 4 + e) * big;
    let w = 128 << 10;
    // Layer 0's attention run going on into layer 1's first expert: not a step.
    p.observe(x(1, 0) - w, x(1, 0), w);
    assert_eq!(stats(&p).steps, 0);
    // Windows of 128 KiB around expert 2's edges touch experts 1 and 3 once each;
    // expert 2 is read 2 MiB deep.
    p.observe(x(0, 2) - w, x(0, 2) - w, w);
    for i in 0..16 {
        p.observe(x(0, 2), x(0, 2) + i * w, w);
    }
    p.observe(x(0, 3), x(0, 3), w);
    // The next layers' steps (layer 2's ends the scored step of layer 1).
    for i in 0..16 {
        p.observe(x(1, 1), x(1, 1) + i * w, w);
    }
    for i in 0..16 {
        p.observe(x(2, 1), x(2, 1) + i * w, w);
    }
    let s = stats(&p);
    assert_eq!((s.steps, s.transitions), (3, 1), "{s:?}");
    assert_eq!(s.read, 1, "one expert in the scored step: {s:?}");
    let g = lock(&p.learned);
    assert_eq!(g.steps[2], 1, "layer 0 expert 2 counted once");
    assert_eq!(g.steps[..4].iter().sum::<u16>(), 1, "its neighbours not");
    assert_eq!(g.counts[2 * 4 + 1], 1, "2 -> 1 learned");
}

#[test]
fn reconstructed_bytes_split_into_experts_and_infrastructure() {
    // Two experts with a gap of infrastructure between them and before them.
    let m = ExpertMap::new(2, 1, [(0, 0, 100..200), (0, 1, 300..400)]).unwrap();
    assert_eq!(m.expert_bytes_in(0..100), 0);
    assert_eq!(m.expert_bytes_in(0..1000), 200);
    assert_eq!(m.expert_bytes_in(150..350), 100);
    assert_eq!(m.expert_bytes_in(199..300), 1);
    assert_eq!(m.expert_bytes_in(400..500), 0);
    let p = Predictor::new(m, ExpertMode::Learn);
    p.loaded(0..256);
    p.loaded(256..512);
    let mut s = ExpertStats::default();
    p.add_stats(&mut s);
    assert_eq!((s.loaded_expert_bytes, s.loaded_infra_bytes), (200, 312));
}

#[test]
fn no_read_ahead_in_an_expert_unless_the_run_spans_more_than_a_token_uses() {
    let ext = (0..5u32).map(|e| {
        let at = 1000 + u64::from(e) * EXPERT;
        (0, e, at..at + EXPERT)
    });
    let m = ExpertMap::new(5, 2, ext).unwrap();
    // A run inside expert 1: no read-ahead past what was read.
    assert_eq!(m.fence(EXPERT + 1010, EXPERT + 1300), Some(EXPERT + 1300));
    // A read-around that began in expert 0 and reached into expert 1.
    assert_eq!(m.fence(EXPERT + 900, EXPERT + 1300), Some(EXPERT + 1300));
    // A run that read all of expert 1, or experts 1 and 2 (a token's two): no
    // read-ahead still.
    assert_eq!(
        m.fence(EXPERT + 900, 2 * EXPERT + 1300),
        Some(2 * EXPERT + 1300)
    );
    assert_eq!(
        m.fence(EXPERT + 900, 3 * EXPERT + 1300),
        Some(3 * EXPERT + 1300)
    );
    // Three whole experts, more than a token uses: a whole-file reader, no fence.
    assert_eq!(m.fence(EXPERT + 900, 4 * EXPERT + 1900), None);
    // Before the experts: read-ahead up to the first one.
    assert_eq!(m.fence(10, 300), Some(1000));
    // Past the last expert: nothing to stop at.
    assert_eq!(m.fence(5 * EXPERT + 1001, 5 * EXPERT + 1050), None);
}

#[test]
fn learns_a_fixed_route_and_queues_the_next_layers_expert() {
    let p = Predictor::new(map(4, 4, 1), ExpertMode::Prefetch);
    let route = |t: u32| move |l: u32| (t + l) % 4;
    // Too few steps to trust: nothing queued.
    for t in 0..MIN_STEPS * 4 {
        let q = token(&p, route(t));
        if t < 4 {
            assert!(q.iter().all(Vec::is_empty), "token {t}: {q:?}");
        }
    }
    // Now every layer but the last queues exactly the next layer's expert.
    let q = token(&p, route(1));
    for l in 0..3 {
        let next = at(&p.map, l + 1, (2 + l) % 4);
        assert_eq!(q[l as usize], vec![next..next + EXPERT], "layer {l}");
    }
    assert!(q[3].is_empty());
    let s0 = stats(&p);
    assert_eq!(s0.steps, 4 * (MIN_STEPS as u64 * 4 + 1));
    // From here on every prediction is read, and every expert read was predicted.
    for t in 0..20 {
        token(&p, route(t));
    }
    let s = stats(&p);
    assert_eq!(s.predicted - s0.predicted, 20 * 3, "{s:?}");
    assert_eq!(s.predicted_read - s0.predicted_read, 20 * 3, "{s:?}");
    assert_eq!(s.read - s0.read, 20 * 3, "{s:?}");
    // A run through the whole file teaches nothing and queues nothing (once it
    // has read one expert whole).
    let before = stats(&p);
    for l in 1..4 {
        for e in 0..4 {
            assert!(p.observe(0, at(&p.map, l, e), EXPERT).is_empty());
        }
    }
    assert_eq!(stats(&p), before);
    // Nor does a batch: a step of more than twice the experts a token uses.
    for _ in 0..3 {
        for l in 0..4 {
            for e in 0..3 {
                obs(&p, at(&p.map, l, e), 300);
            }
        }
    }
    // (The batch's first read ends the last token's step in layer 3: one expert.)
    assert_eq!(stats(&p).read, before.read + 1);
    // Repeated reads of the same expert queue nothing more.
    assert!(obs(&p, at(&p.map, 3, 0), 300).is_empty());
}

#[test]
fn a_random_route_queues_little_and_learn_mode_queues_nothing() {
    let p = Predictor::new(map(3, 8, 2), ExpertMode::Learn);
    let mut x = 12345u64;
    let mut next = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) as u32 % 8
    };
    for _ in 0..500 {
        for l in 0..3 {
            let (a, b) = (next(), next());
            assert!(obs(&p, at(&p.map, l, a), 300).is_empty());
            assert!(obs(&p, at(&p.map, l, b), 300).is_empty());
        }
    }
    let s = stats(&p);
    assert!(!s.prefetch);
    // No successor reaches MIN_P often: few predictions, and those were guesses.
    assert!(s.predicted < s.read / 10, "{s:?}");
}

#[test]
fn counts_decay_and_survive_a_save_and_load() {
    let p = Predictor::new(map(2, 2, 1), ExpertMode::Prefetch);
    for _ in 0..DECAY_AT + 10 {
        token(&p, |_| 0);
    }
    let bytes = p.save(7).expect("dirty");
    assert!(p.save(7).is_none(), "nothing new since the save");
    {
        let g = lock(&p.learned);
        assert!(u32::from(g.steps[0]) < DECAY_AT && g.steps[0] > 100);
        assert_eq!(g.counts[0], g.steps[0]);
    }
    let q = Predictor::new(map(2, 2, 1), ExpertMode::Prefetch);
    q.load(7, &bytes).unwrap();
    // Learned before: the first token already queues layer 1's expert 0.
    assert_eq!(
        obs(&q, at(&q.map, 0, 0), 300),
        vec![at(&q.map, 1, 0)..at(&q.map, 1, 0) + EXPERT]
    );
    assert_eq!(stats(&q).loaded_steps, u64::from(lock(&p.learned).steps[0]));
    // Another key, shape, a flipped byte or a short file is refused.
    assert!(q.load(8, &bytes).unwrap_err().contains("another archive"));
    assert!(Predictor::new(map(2, 3, 1), ExpertMode::Prefetch)
        .load(7, &bytes)
        .is_err());
    let mut flipped = bytes.clone();
    flipped[40] ^= 1;
    assert!(q.load(7, &flipped).unwrap_err().contains("checksum"));
    assert!(q.load(7, &bytes[..20]).is_err());
}
