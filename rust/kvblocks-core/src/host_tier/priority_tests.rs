//! Tests of the tier's eviction by retention priority.

use super::*;
use crate::block_hash::BlockHasher;
use crate::config::HashAlgo;

fn hash(token: u32) -> BlockHash {
    let mut h = BlockHasher::new(HashAlgo::Blake3);
    let ns = h.namespace(None, None).expect("no salt, no LoRA");
    h.block(None, &ns, &[token])
}

fn prio(p: i64) -> RetentionPriority {
    RetentionPriority::new(p).unwrap()
}

fn settle(t: &mut HostTier) {
    t.mark_taken();
    t.confirm();
}

#[test]
fn lowest_priority_is_evicted_first_and_low_offers_are_skipped() {
    let mut t = HostTier::new(3, OffloadPolicy::OnEvict);
    let mut ops = Vec::new();
    t.offload(0, 1, hash(1), prio(90), &mut ops);
    t.offload(0, 2, hash(2), prio(10), &mut ops);
    t.offload(0, 3, hash(3), prio(50), &mut ops);
    settle(&mut t);
    // Full: a priority-50 offer evicts the priority-10 block, though hash(1) is older.
    assert_eq!(
        t.offload(0, 4, hash(4), prio(50), &mut ops),
        (Some((0, hash(2))), true)
    );
    settle(&mut t);
    // Among equals (3 and 4 at 50) the least recently used goes.
    assert_eq!(
        t.offload(0, 5, hash(5), prio(60), &mut ops),
        (Some((0, hash(3))), true)
    );
    settle(&mut t);
    // An offer below everything held is skipped, nothing evicted.
    assert_eq!(t.offload(0, 6, hash(6), prio(10), &mut ops), (None, false));
    assert_eq!(t.stats().offloads_skipped, 1);
    assert!(t.lookup_ready(0, &hash(1)).is_some());
    // Re-offering a held block raises its priority: hash(4) now outranks hash(5).
    t.raise_priority(0, &hash(4), prio(95));
    assert_eq!(
        t.offload(0, 7, hash(7), prio(60), &mut ops),
        (Some((0, hash(5))), true)
    );
    settle(&mut t);
    assert_eq!(
        t.slot_priority(t.lookup_ready(0, &hash(4)).unwrap()),
        prio(95)
    );
    t.check().unwrap();
}
