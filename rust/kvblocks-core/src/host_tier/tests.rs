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

/// Ops the engine could not finish: the slots they were writing are emptied (no hit, no
/// map entry, reused first), a load's source keeps its block and is unpinned, and ops
/// queued after the taken ones stay pinned.
#[test]
fn discard_empties_written_slots_and_unpins_reads() {
    let mut t = HostTier::new(4, OffloadPolicy::OnEvict);
    let mut ops = Vec::new();
    assert_eq!(t.offload(0, 5, hash(1), P, &mut ops), (None, true));
    t.mark_taken();
    t.confirm();
    let ready = t.lookup_ready(0, &hash(1)).unwrap();
    // A load from the written slot, an offload and an import, all taken and failed.
    t.pin_read(ready);
    assert_eq!(t.offload(0, 6, hash(2), P, &mut ops), (None, true));
    t.mark_taken();
    let (imported, _) = t.reserve(0, hash(3), P).unwrap();
    // An offload queued after them, not taken.
    assert_eq!(t.offload(1, 7, hash(4), P, &mut ops), (None, true));
    t.check().unwrap();
    let mut emptied = t.discard();
    emptied.sort_unstable();
    let written = t.slot_of(0, &hash(2));
    assert!(written.is_none() && t.slot_of(0, &hash(3)).is_none());
    assert_eq!(emptied.len(), 2);
    assert!(emptied.contains(&imported));
    assert_eq!(t.lookup_ready(0, &hash(1)), Some(ready));
    t.check().unwrap();
    // The queued offload is still pinned: it becomes a hit only once taken and confirmed.
    t.confirm();
    assert!(t.lookup_ready(1, &hash(4)).is_none());
    t.mark_taken();
    t.confirm();
    assert!(t.lookup_ready(1, &hash(4)).is_some());
    // An emptied slot is reused before the written one is evicted.
    assert_eq!(t.offload(0, 8, hash(5), P, &mut ops), (None, true));
    assert_eq!(t.lookup_ready(0, &hash(1)), Some(ready));
    t.check().unwrap();
}
