//! Retention priorities in the host tier, and the LoRA fields of `BlockStored` events.

mod common;

use common::*;
use kvblocks_core::{
    HashAlgo, KVCacheManager, KvCacheEvent, KvError, Medium, OffloadPolicy, RetentionPriority,
};

fn prio(p: i64) -> RetentionPriority {
    RetentionPriority::new(p).unwrap()
}

/// Prefill `prompt` at `priority`, free it, push it out of the GPU pool and confirm the ops.
fn prefill_at(m: &mut KVCacheManager, id: u64, prompt: &[u32], priority: i64) {
    m.add_sequence(id, prompt, None, None).unwrap();
    m.set_retention_priority(id, prio(priority)).unwrap();
    let computed = m.num_computed_tokens(id).unwrap();
    m.allocate_slots(id, prompt.len() - computed, 0)
        .unwrap()
        .expect("enough blocks");
    m.commit(id, prompt.len() - computed, &[]).unwrap();
    m.free(id).unwrap();
    m.take_memory_ops();
    m.confirm_memory_ops();
    m.check_invariants().unwrap();
}

fn flood(m: &mut KVCacheManager, policy_id: u64, rounds: u32, priority: i64) {
    for r in 0..rounds {
        // 4 blocks per prompt: every round evicts the previous round's GPU blocks.
        prefill_at(
            m,
            policy_id + r as u64,
            &toks(10_000 + 100 * r, 16),
            priority,
        );
    }
}

#[test]
fn a_high_priority_prefix_survives_a_low_priority_flood_in_the_tier() {
    for policy in [OffloadPolicy::OnEvict, OffloadPolicy::WriteThrough] {
        // 4 usable GPU blocks, 6 tier slots.
        let mut m = manager_with(5, 4, |c| {
            c.host_cache_blocks = 6;
            c.host_offload = policy;
        });
        let prompt = toks(0, 13); // 3 full blocks, all hittable
        prefill_at(&mut m, 1, &prompt, 90);
        flood(&mut m, 100, 8, 10);
        assert_eq!(
            m.add_sequence(2, &prompt, None, None).unwrap(),
            12,
            "{policy:?}: the priority-90 blocks were evicted by priority-10 ones"
        );
        m.check_invariants().unwrap();
        let stats = m.tier_stats().unwrap();
        assert!(stats.evictions > 0, "{policy:?}: the flood evicted nothing");
    }
}

#[test]
fn with_equal_priorities_the_flood_evicts_the_prefix() {
    // The baseline the test above differs from: LRU alone loses the prefix.
    let mut m = manager_with(5, 4, |c| c.host_cache_blocks = 6);
    let prompt = toks(0, 13);
    prefill_at(&mut m, 1, &prompt, 35);
    flood(&mut m, 100, 8, 35);
    assert_eq!(m.add_sequence(2, &prompt, None, None).unwrap(), 0);
}

#[test]
fn a_shared_block_keeps_the_highest_priority() {
    let mut m = manager_with(5, 4, |c| c.host_cache_blocks = 6);
    let prompt = toks(0, 13);
    prefill_at(&mut m, 1, &prompt, 10);
    // A priority-90 sequence claims the cached prefix (a GPU hit) and frees it.
    prefill_at(&mut m, 2, &prompt, 90);
    flood(&mut m, 100, 8, 50);
    assert_eq!(m.add_sequence(3, &prompt, None, None).unwrap(), 12);
}

#[test]
fn retention_priority_is_per_sequence_and_inherited_by_forks() {
    let mut m = manager(8, 4);
    m.add_sequence(1, &toks(0, 5), None, None).unwrap();
    assert_eq!(m.retention_priority(1).unwrap(), RetentionPriority::DEFAULT);
    m.set_retention_priority(1, prio(80)).unwrap();
    m.allocate_slots(1, 5, 0).unwrap().unwrap();
    m.commit(1, 5, &[]).unwrap();
    m.fork(1, 2).unwrap();
    assert_eq!(m.retention_priority(2).unwrap().get(), 80);
    assert!(matches!(
        m.set_retention_priority(9, prio(1)),
        Err(KvError::UnknownSequence(9))
    ));
    assert!(matches!(
        RetentionPriority::new(101),
        Err(KvError::InvalidArgument(_))
    ));
}

fn stored(m: &mut KVCacheManager) -> Vec<kvblocks_core::BlockStored> {
    m.take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvCacheEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

#[test]
fn block_stored_events_carry_the_lora_name_and_vllm_extra_keys() {
    let mut m = manager_with(16, 4, |c| {
        c.hash_algo = HashAlgo::Sha256Cbor;
        c.record_events = true;
        c.host_cache_blocks = 8;
        c.host_offload = OffloadPolicy::WriteThrough;
    });
    m.register_lora(7, "sql-adapter", "/adapters/sql");
    m.add_sequence(1, &toks(0, 9), Some(b"tenant"), Some(7))
        .unwrap();
    m.allocate_slots(1, 9, 0).unwrap().unwrap();
    m.commit(1, 9, &[]).unwrap();
    let events = stored(&mut m);
    let gpu: Vec<_> = events.iter().filter(|s| s.medium == Medium::Gpu).collect();
    assert_eq!(gpu.len(), 1);
    let ev = gpu[0];
    assert_eq!(ev.lora_id, Some(7));
    assert_eq!(ev.lora_name.as_deref(), Some("sql-adapter"));
    let (lora, salt) = ev.block_extra_keys(0).expect("first block has keys");
    assert_eq!(
        (lora.map(|l| (&*l.name, &*l.path)), salt),
        (Some(("sql-adapter", "/adapters/sql")), Some("tenant"))
    );
    let (lora, salt) = ev
        .block_extra_keys(1)
        .expect("second block has the LoRA key");
    assert!(lora.is_some() && salt.is_none());
    // Write-through copies carry the same keys, one block each: the salt only on block 0
    // (announced once their writes are confirmed).
    assert!(events.iter().all(|s| s.medium == Medium::Gpu));
    m.take_memory_ops();
    m.confirm_memory_ops();
    let events = stored(&mut m);
    let cpu: Vec<_> = events.iter().filter(|s| s.medium == Medium::Cpu).collect();
    assert_eq!(cpu.len(), 2);
    assert_eq!(cpu[0].block_extra_keys(0).unwrap().1, Some("tenant"));
    assert_eq!(cpu[1].block_extra_keys(0).unwrap().1, None);
    assert!(cpu
        .iter()
        .all(|s| s.lora_name.as_deref() == Some("sql-adapter")));

    // No LoRA, no salt: vLLM's entry is None for every block.
    m.add_sequence(2, &toks(100, 9), None, None).unwrap();
    m.allocate_slots(2, 9, 0).unwrap().unwrap();
    m.commit(2, 9, &[]).unwrap();
    let ev = &stored(&mut m)[0];
    assert!(ev.extra_keys.is_some() && ev.block_extra_keys(0).is_none());
    assert_eq!((ev.lora_id, ev.lora_name.as_deref()), (None, None));
}

#[test]
fn other_algorithms_report_the_lora_name_but_no_extra_keys() {
    let mut m = manager_with(16, 4, |c| c.record_events = true);
    m.register_lora(3, "chat", "");
    m.add_sequence(1, &toks(0, 9), None, Some(3)).unwrap();
    m.allocate_slots(1, 9, 0).unwrap().unwrap();
    m.commit(1, 9, &[]).unwrap();
    let ev = &stored(&mut m)[0];
    assert_eq!(ev.lora_name.as_deref(), Some("chat"));
    assert!(ev.extra_keys.is_none() && ev.block_extra_keys(0).is_none());
}

#[test]
fn gpu_eviction_takes_lower_priorities_first_and_lru_among_equals() {
    // 8 usable blocks, no tier.
    let mut m = manager(9, 4);
    prefill_at(&mut m, 1, &toks(0, 12), 90); // 3 cached blocks, freed
    prefill_at(&mut m, 2, &toks(100, 12), 10); // 3 more, lower priority
    let order = m.free_block_ids();
    // Uncached blocks first, then priority 10 (blocks 4-6), then priority 90 (1-3).
    let mut tail: Vec<u32> = order[order.len() - 6..].to_vec();
    tail[..3].sort_unstable();
    tail[3..].sort_unstable();
    assert_eq!(tail, vec![4, 5, 6, 1, 2, 3]);
    // 5 fresh blocks: the 2 never used, then the 3 of priority 10; priority 90 stays.
    prefill_at(&mut m, 3, &toks(500, 20), 35);
    assert_eq!(m.add_sequence(4, &toks(0, 13), None, None).unwrap(), 12);
    assert_eq!(m.add_sequence(5, &toks(100, 13), None, None).unwrap(), 0);
    m.check_invariants().unwrap();
}

#[test]
fn a_duplicate_commit_keeps_the_content_at_its_own_priority() {
    let mut m = manager(9, 4);
    prefill_at(&mut m, 1, &toks(0, 4), 10); // block 1 cached at 10, free
                                            // The same content committed again by a priority-80 sequence (a duplicate: a prompt
                                            // of one block never claims it, its last token is always computed).
    m.add_sequence(3, &toks(0, 4), None, None).unwrap();
    m.set_retention_priority(3, prio(80)).unwrap();
    m.allocate_slots(3, 4, 0).unwrap().unwrap(); // block 2
    m.commit(3, 4, &[]).unwrap();
    m.free(3).unwrap();
    m.check_invariants().unwrap();
    // The copy is cached at 80: last in the queue; block 1 stays at 10.
    assert_eq!(m.free_block_ids().last(), Some(&2));
    assert_eq!(m.stats().num_cached_blocks, 2);
    // 7 blocks at priority 50: the 6 uncached ones, then the priority-10 copy.
    prefill_at(&mut m, 4, &toks(500, 28), 50);
    assert_eq!(m.stats().evictions, 1);
    // The priority-80 copy keeps the content.
    assert_eq!(m.add_sequence(5, &toks(0, 5), None, None).unwrap(), 4);
    m.allocate_slots(5, 1, 0).unwrap().unwrap();
    assert_eq!(m.block_table(5).unwrap()[0], 2);
    m.check_invariants().unwrap();
}
