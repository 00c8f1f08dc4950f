//! Tests of the tier's LRU eviction and pins.

use super::*;
use crate::block_hash::BlockHasher;
use crate::config::HashAlgo;

fn hash(token: u32) -> BlockHash {
    let mut h = BlockHasher::new(HashAlgo::Blake3);
    let ns = h.namespace(None, None).expect("no salt, no LoRA");
    h.block(None, &ns, &[token])
}

const P: RetentionPriority = RetentionPriority::DEFAULT;

#[test]
fn lru_eviction_and_pins() {
    let mut t = HostTier::new(2, OffloadPolicy::OnEvict);
    let mut ops = Vec::new();
    assert_eq!(t.offload(0, 5, hash(1), P, &mut ops), (None, true));
    assert_eq!(t.offload(0, 6, hash(2), P, &mut ops), (None, true));
    // Both slots are being written: pinned, no hit, no room.
    assert!(t.lookup_ready(0, &hash(1)).is_none());
    assert_eq!(t.offload(0, 7, hash(3), P, &mut ops), (None, false));
    assert_eq!(t.stats().offloads_skipped, 1);
    t.check().unwrap();
    // Confirm without taking: still pinned.
    t.confirm();
    assert!(t.lookup_ready(0, &hash(1)).is_none());
    t.mark_taken();
    t.confirm();
    let s1 = t.lookup_ready(0, &hash(1)).unwrap();
    assert!(t.lookup_ready(0, &hash(2)).is_some());
    // A load pins slot 1: the next offload evicts hash(2) instead.
    t.pin_read(s1);
    assert_eq!(
        t.offload(0, 8, hash(3), P, &mut ops),
        (Some((0, hash(2))), true)
    );
    assert_eq!(t.offload(0, 9, hash(4), P, &mut ops), (None, false));
    t.check().unwrap();
    t.mark_taken();
    t.confirm();
    assert!(t.lookup_ready(0, &hash(1)).is_some() && t.lookup_ready(0, &hash(3)).is_some());
    assert_eq!(
        ops.iter().map(|o| (o.src, o.dst)).collect::<Vec<_>>(),
        vec![(5, 0), (6, 1), (8, 1)]
    );
    assert_eq!(t.stats().evictions, 1);
    assert_eq!(t.clear_unpinned().len(), 2);
    t.check().unwrap();
    assert_eq!(t.stats().num_blocks, 0);
}
