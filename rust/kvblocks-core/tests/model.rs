//! Model-based test: random operation sequences against a simple reference model.
//!
//! The model keeps the same rules in the plainest data structures (a `VecDeque` free
//! queue, a `BTreeMap` of sequences, linear scans) and is compared with the manager after
//! every step: return values (error kinds included), free-queue orders, block tables,
//! computed counts, copy-on-write pairs, events and counters; `check_invariants()` runs
//! after every step too.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use kvblocks_core::{
    AllocStatus, BatchArg, BlockHash, BlockHasher, BlockRemoved, BlockStored, HashAlgo,
    KVCacheManager, KvCacheEvent, KvError, ManagerConfig,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct MSeq {
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    table: Vec<u32>,
    reserved: Option<usize>,
    allocated: bool,
    ns: BlockHash,
    lora: Option<u64>,
    hashes: Vec<BlockHash>,
    cap: usize,
    cached_tokens: usize,
    registered: usize,
    released: usize,
    swapped: bool,
}

#[derive(Debug, Default, Clone, PartialEq)]
struct MCounters {
    queries: u64,
    hits: u64,
    evictions: u64,
    cow: u64,
    out: u64,
    inn: u64,
}

struct Model {
    bs: usize,
    num_blocks: usize,
    caching: bool,
    window: Option<usize>,
    wm: usize,
    free: VecDeque<u32>,
    rc: Vec<u32>,
    hash_of: Vec<Option<BlockHash>>,
    map: HashMap<BlockHash, u32>,
    cpu_free: VecDeque<u32>,
    cpu_rc: Vec<u32>,
    seqs: BTreeMap<u64, MSeq>,
    cow: Vec<[i64; 2]>,
    events: Vec<KvCacheEvent>,
    c: MCounters,
    hasher: BlockHasher,
}

/// Error kinds compared between model and manager (messages are not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Invalid,
    Oob,
    Unknown,
    Dup,
    State,
}

fn kind(e: &KvError) -> Kind {
    match e {
        KvError::InvalidArgument(_) => Kind::Invalid,
        KvError::OutOfBlocks(_) => Kind::Oob,
        KvError::UnknownSequence(_) => Kind::Unknown,
        KvError::DuplicateSequence(_) => Kind::Dup,
        KvError::SequenceState(_) => Kind::State,
        KvError::InvariantViolation(m) => panic!("invariant violation: {m}"),
    }
}

type R<T> = Result<T, Kind>;

impl Model {
    fn new(c: &ManagerConfig) -> Self {
        Model {
            bs: c.block_size,
            num_blocks: c.num_blocks,
            caching: c.enable_prefix_caching,
            window: c.sliding_window,
            wm: (c.watermark * c.num_blocks as f64).floor() as usize,
            free: (1..c.num_blocks as u32).collect(),
            rc: vec![0; c.num_blocks],
            hash_of: vec![None; c.num_blocks],
            map: HashMap::new(),
            cpu_free: (0..c.num_cpu_blocks as u32).collect(),
            cpu_rc: vec![0; c.num_cpu_blocks],
            seqs: BTreeMap::new(),
            cow: Vec::new(),
            events: Vec::new(),
            c: MCounters::default(),
            hasher: BlockHasher::new(c.hash_algo),
        }
    }

    fn probe(&self, s: &MSeq) -> usize {
        if !self.caching {
            return 0;
        }
        let n = s.cap.min(s.hashes.len());
        s.hashes[..n]
            .iter()
            .take_while(|h| self.map.contains_key(*h))
            .count()
    }

    fn computed_of(&self, s: &MSeq) -> usize {
        if s.allocated {
            s.computed
        } else {
            self.probe(s) * self.bs
        }
    }

    fn get(&self, id: u64) -> R<&MSeq> {
        self.seqs.get(&id).ok_or(Kind::Unknown)
    }

    fn pop(&mut self) -> u32 {
        let b = self.free.pop_front().expect("planned");
        self.rc[b as usize] = 1;
        if let Some(h) = self.hash_of[b as usize].take() {
            if self.map.get(&h) == Some(&b) {
                self.map.remove(&h);
            }
            self.c.evictions += 1;
            self.events.push(KvCacheEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![h],
            }));
        }
        b
    }

    fn release(&mut self, b: u32) {
        if b == 0 {
            return;
        }
        self.rc[b as usize] -= 1;
        if self.rc[b as usize] == 0 {
            if self.hash_of[b as usize].is_some() {
                self.free.push_back(b);
            } else {
                self.free.push_front(b);
            }
        }
    }

    fn release_cpu(&mut self, b: u32) {
        self.cpu_rc[b as usize] -= 1;
        if self.cpu_rc[b as usize] == 0 {
            self.cpu_free.push_front(b);
        }
    }

    fn add(&mut self, id: u64, tokens: &[u32], salt: Option<&[u8]>, lora: Option<u64>) -> R<usize> {
        if self.seqs.contains_key(&id) {
            return Err(Kind::Dup);
        }
        let mut s = MSeq {
            tokens: tokens.to_vec(),
            prompt_len: tokens.len(),
            computed: 0,
            table: vec![],
            reserved: None,
            allocated: false,
            ns: BlockHash::default(),
            lora,
            hashes: vec![],
            cap: 0,
            cached_tokens: 0,
            registered: 0,
            released: 0,
            swapped: false,
        };
        if self.caching {
            s.ns = self.hasher.namespace(salt, lora);
            for i in 0..tokens.len() / self.bs {
                let parent = if i == 0 { None } else { Some(s.hashes[i - 1]) };
                let h = self.hasher.block(
                    parent.as_ref(),
                    &s.ns,
                    &tokens[i * self.bs..(i + 1) * self.bs],
                );
                s.hashes.push(h);
            }
            s.cap = usize::MAX;
            let max_hit = tokens.len().saturating_sub(1) / self.bs;
            s.cap = self.probe(&s).min(max_hit);
        }
        let r = s.cap * self.bs;
        self.seqs.insert(id, s);
        Ok(r)
    }

    fn validate_alloc(&self, id: u64, new: usize) -> R<()> {
        let s = self.get(id)?;
        if s.swapped {
            return Err(Kind::State);
        }
        if self.computed_of(s) + new > s.tokens.len() {
            return Err(Kind::Invalid);
        }
        Ok(())
    }

    fn serve_alloc(&mut self, id: u64, new: usize, la: usize) -> Option<Vec<i32>> {
        let s = self.seqs[&id].clone();
        let bs = self.bs;
        let (claim, from_free, computed, tlen) = if s.allocated {
            (0, 0, s.computed, s.table.len())
        } else {
            let claim = self.probe(&s);
            let ff = s.hashes[..claim]
                .iter()
                .filter(|h| self.rc[self.map[*h] as usize] == 0)
                .count();
            (claim, ff, claim * bs, claim)
        };
        let reserved = computed + new + la;
        let append = reserved.div_ceil(bs).saturating_sub(tlen);
        let pos = computed / bs;
        let cow = new + la > 0
            && s.allocated
            && pos < tlen
            && s.table[pos] != 0
            && self.rc[s.table[pos] as usize] > 1;
        if append + cow as usize + from_free > self.free.len() {
            return None;
        }
        let mut s = s;
        let mut taken = vec![];
        if !s.allocated {
            for h in &s.hashes[..claim] {
                let b = self.map[h];
                if self.rc[b as usize] == 0 {
                    let at = self.free.iter().position(|&x| x == b).unwrap();
                    self.free.remove(at);
                }
                self.rc[b as usize] += 1;
                s.table.push(b);
            }
            s.allocated = true;
            s.computed = claim * bs;
            s.cached_tokens = claim * bs;
            s.registered = claim;
            if self.caching {
                self.c.queries += s.prompt_len as u64;
                self.c.hits += (claim * bs) as u64;
            }
        }
        if cow {
            let src = s.table[pos];
            let dst = self.pop();
            self.rc[src as usize] -= 1;
            s.table[pos] = dst;
            self.cow.push([src as i64, dst as i64]);
            self.c.cow += 1;
            taken.push(dst as i32);
        }
        for _ in 0..append {
            let b = self.pop();
            s.table.push(b);
            taken.push(b as i32);
        }
        s.reserved = Some(reserved);
        self.seqs.insert(id, s);
        Some(taken)
    }

    fn allocate(&mut self, id: u64, new: usize, la: usize) -> R<Option<Vec<i32>>> {
        self.validate_alloc(id, new)?;
        Ok(self.serve_alloc(id, new, la))
    }

    /// Unknown ids and duplicates, in list order (the manager reports the first problem).
    fn check_ids(&self, ids: &[u64]) -> R<()> {
        let mut seen = HashSet::new();
        for id in ids {
            self.get(*id)?;
            if !seen.insert(id) {
                return Err(Kind::Invalid);
            }
        }
        Ok(())
    }

    fn allocate_batch(&mut self, ids: &[u64], new: &[i64], la: usize) -> R<usize> {
        self.check_ids(ids)?;
        for (id, &n) in ids.iter().zip(new) {
            if n < 0 {
                return Err(Kind::Invalid);
            }
            self.validate_alloc(*id, n as usize)?;
        }
        for (i, (id, &n)) in ids.iter().zip(new).enumerate() {
            if self.serve_alloc(*id, n as usize, la).is_none() {
                return Ok(i);
            }
        }
        Ok(ids.len())
    }

    fn validate_commit(&self, id: u64, n: usize) -> R<()> {
        let s = self.get(id)?;
        if s.swapped {
            return Err(Kind::State);
        }
        let limit = s.reserved.unwrap_or(s.computed).min(s.tokens.len());
        if s.computed + n > limit {
            return Err(Kind::Invalid);
        }
        Ok(())
    }

    fn apply_commit(&mut self, id: u64, n: usize, new_tokens: &[u32]) {
        let bs = self.bs;
        let mut s = self.seqs.remove(&id).unwrap();
        s.tokens.extend_from_slice(new_tokens);
        s.computed += n;
        s.reserved = None;
        let full = s.computed / bs;
        if self.caching {
            while s.hashes.len() < full {
                let i = s.hashes.len();
                let parent = if i == 0 { None } else { Some(s.hashes[i - 1]) };
                let h = self
                    .hasher
                    .block(parent.as_ref(), &s.ns, &s.tokens[i * bs..(i + 1) * bs]);
                s.hashes.push(h);
            }
            let mut run: Option<BlockStored> = None;
            for i in s.registered..full {
                let h = s.hashes[i];
                let b = s.table[i];
                if b == 0 || self.map.contains_key(&h) || self.hash_of[b as usize].is_some() {
                    if let Some(ev) = run.take() {
                        self.events.push(KvCacheEvent::BlockStored(ev));
                    }
                    continue;
                }
                self.map.insert(h, b);
                self.hash_of[b as usize] = Some(h);
                let parent = if i == 0 { None } else { Some(s.hashes[i - 1]) };
                let ev = run.get_or_insert_with(|| BlockStored {
                    block_hashes: vec![],
                    parent_block_hash: parent,
                    token_ids: vec![],
                    block_size: bs,
                    lora_id: s.lora,
                });
                ev.block_hashes.push(h);
                ev.token_ids
                    .extend_from_slice(&s.tokens[i * bs..(i + 1) * bs]);
            }
            if let Some(ev) = run {
                self.events.push(KvCacheEvent::BlockStored(ev));
            }
        }
        s.registered = s.registered.max(full);
        if let Some(w) = self.window {
            let outside = ((s.computed + 1).saturating_sub(w) / bs).min(s.table.len());
            for i in (s.released..outside).rev() {
                let b = s.table[i];
                s.table[i] = 0;
                self.release(b);
            }
            s.released = s.released.max(outside);
        }
        self.seqs.insert(id, s);
    }

    fn commit(&mut self, id: u64, n: usize, toks: &[u32]) -> R<()> {
        self.validate_commit(id, n)?;
        self.apply_commit(id, n, toks);
        Ok(())
    }

    fn commit_batch(&mut self, ids: &[u64], n: &[i64], toks: &[i64]) -> R<()> {
        self.check_ids(ids)?;
        for (id, &k) in ids.iter().zip(n) {
            if k < 0 {
                return Err(Kind::Invalid);
            }
            self.validate_commit(*id, k as usize)?;
        }
        for ((id, &k), &t) in ids.iter().zip(n).zip(toks) {
            let t: Vec<u32> = if t >= 0 { vec![t as u32] } else { vec![] };
            self.apply_commit(*id, k as usize, &t);
        }
        Ok(())
    }

    fn fork(&mut self, p: u64, c: u64) -> R<()> {
        let s = self.get(p)?.clone();
        if self.seqs.contains_key(&c) {
            return Err(Kind::Dup);
        }
        if s.swapped || s.reserved.is_some() {
            return Err(Kind::State);
        }
        for &b in &s.table {
            if b != 0 {
                self.rc[b as usize] += 1;
            }
        }
        self.seqs.insert(c, s);
        Ok(())
    }

    fn free_seq(&mut self, id: u64) -> R<()> {
        let s = self.seqs.remove(&id).ok_or(Kind::Unknown)?;
        for i in (s.released..s.table.len()).rev() {
            if s.swapped {
                self.release_cpu(s.table[i]);
            } else {
                self.release(s.table[i]);
            }
        }
        Ok(())
    }

    fn swap_check(&self, ids: &[u64], out: bool) -> R<Vec<u32>> {
        self.check_ids(ids)?;
        for id in ids {
            let s = &self.seqs[id];
            if out && (s.swapped || s.reserved.is_some()) || !out && !s.swapped {
                return Err(Kind::State);
            }
        }
        let mut blocks = vec![];
        for id in ids {
            let s = &self.seqs[id];
            for &b in &s.table[s.released..] {
                if !blocks.contains(&b) {
                    blocks.push(b);
                }
            }
        }
        Ok(blocks)
    }

    fn swap_out(&mut self, ids: &[u64]) -> R<Vec<[i64; 2]>> {
        let blocks = self.swap_check(ids, true)?;
        if blocks.len() > self.cpu_free.len() {
            return Err(Kind::Oob);
        }
        let mut map = HashMap::new();
        let mut rows = vec![];
        for &g in &blocks {
            let c = self.cpu_free.pop_front().unwrap();
            map.insert(g, c);
            rows.push([g as i64, c as i64]);
        }
        for id in ids {
            let mut s = self.seqs.remove(id).unwrap();
            for i in (s.released..s.table.len()).rev() {
                let g = s.table[i];
                let c = map[&g];
                self.cpu_rc[c as usize] += 1;
                s.table[i] = c;
                self.release(g);
            }
            s.swapped = true;
            self.seqs.insert(*id, s);
        }
        self.c.out += blocks.len() as u64;
        Ok(rows)
    }

    fn swap_in(&mut self, ids: &[u64]) -> R<Vec<[i64; 2]>> {
        let blocks = self.swap_check(ids, false)?;
        if blocks.len() > self.free.len() {
            return Err(Kind::Oob);
        }
        let mut map = HashMap::new();
        let mut rows = vec![];
        for &c in &blocks {
            let g = self.pop();
            self.rc[g as usize] = 0;
            map.insert(c, g);
            rows.push([c as i64, g as i64]);
        }
        for id in ids {
            let mut s = self.seqs.remove(id).unwrap();
            for i in (s.released..s.table.len()).rev() {
                let c = s.table[i];
                let g = map[&c];
                self.rc[g as usize] += 1;
                s.table[i] = g;
                self.release_cpu(c);
            }
            s.swapped = false;
            self.seqs.insert(*id, s);
        }
        self.c.inn += blocks.len() as u64;
        Ok(rows)
    }

    fn can_allocate(&self, id: u64, la: usize) -> R<AllocStatus> {
        let s = self.get(id)?;
        if s.swapped || s.allocated {
            return Err(Kind::State);
        }
        let required = (s.tokens.len() + la).div_ceil(self.bs);
        let hit = self.probe(s);
        let shared = s.hashes[..hit]
            .iter()
            .filter(|h| self.rc[self.map[*h] as usize] > 0)
            .count();
        let needed = required - shared;
        if required > (self.num_blocks - 1).saturating_sub(self.wm) {
            return Ok(AllocStatus::Never);
        }
        if (self.free.len() as i64) - (needed as i64) < self.wm as i64 {
            return Ok(AllocStatus::Later);
        }
        Ok(AllocStatus::Ok)
    }

    fn refresh(&mut self, ids: &[u64]) -> R<Vec<i64>> {
        for id in ids {
            let s = self.get(*id)?;
            if s.swapped || s.allocated {
                return Err(Kind::State);
            }
        }
        let mut out = vec![];
        for id in ids {
            let mut s = self.seqs.remove(id).expect("checked");
            s.cap = usize::MAX;
            let max_hit = s.prompt_len.saturating_sub(1) / self.bs;
            s.cap = self.probe(&s).min(max_hit);
            out.push((s.cap * self.bs) as i64);
            self.seqs.insert(*id, s);
        }
        Ok(out)
    }

    fn reset(&mut self) -> bool {
        if self.rc.iter().any(|&r| r > 0) {
            return false;
        }
        if self.caching {
            self.map.clear();
            self.hash_of.iter_mut().for_each(|h| *h = None);
            self.events.push(KvCacheEvent::AllBlocksCleared);
        }
        true
    }
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        id: u64,
        len: usize,
        family: u32,
        salt: u8,
        lora: u8,
    },
    Allocate {
        id: u64,
        new: usize,
        la: usize,
    },
    /// Allocate whatever the sequence still needs (the common scheduler call).
    AllocateRest {
        id: u64,
        la: usize,
    },
    AllocateBatch {
        ids: Vec<u64>,
        new: Vec<i64>,
        la: usize,
    },
    Commit {
        id: u64,
        n: usize,
        toks: Vec<u32>,
    },
    /// Commit everything reserved and known, then append one token.
    CommitAll {
        id: u64,
        tok: u32,
    },
    CommitBatch {
        ids: Vec<u64>,
        n: Vec<i64>,
        toks: Vec<i64>,
    },
    Fork {
        parent: u64,
        child: u64,
    },
    Free {
        id: u64,
    },
    SwapOut {
        ids: Vec<u64>,
    },
    SwapIn {
        ids: Vec<u64>,
    },
    CanAllocate {
        id: u64,
        la: usize,
    },
    /// Re-probe waiting sequences' cached prefixes.
    Refresh {
        ids: Vec<u64>,
    },
    Reset,
    /// Add, allocate and commit a whole prompt (expanded into those three steps).
    Prefill {
        id: u64,
        len: usize,
        family: u32,
    },
    /// Allocate and commit `steps` decode tokens (expanded into those steps).
    Decode {
        id: u64,
        steps: usize,
    },
    /// Fork, then decode the child and the parent (expanded; exercises copy-on-write).
    ForkDecode {
        parent: u64,
        child: u64,
        steps: usize,
    },
    /// Swap one sequence out and straight back in (expanded).
    SwapRoundTrip {
        id: u64,
    },
}

/// Replace the composite operations by their steps.
fn expand(ops: Vec<Op>) -> Vec<Op> {
    let mut out = Vec::with_capacity(ops.len() * 2);
    for op in ops {
        match op {
            Op::Prefill { id, len, family } => {
                out.push(Op::Add {
                    id,
                    len,
                    family,
                    salt: 0,
                    lora: 0,
                });
                out.push(Op::AllocateRest { id, la: 0 });
                out.push(Op::CommitAll {
                    id,
                    tok: family + 7,
                });
            }
            Op::Decode { id, steps } => {
                for k in 0..steps {
                    out.push(Op::AllocateRest { id, la: 0 });
                    out.push(Op::CommitAll { id, tok: k as u32 });
                }
            }
            Op::ForkDecode {
                parent,
                child,
                steps,
            } => {
                out.push(Op::Fork { parent, child });
                for k in 0..steps {
                    for id in [child, parent] {
                        out.push(Op::AllocateRest { id, la: 0 });
                        out.push(Op::CommitAll {
                            id,
                            tok: k as u32 + id as u32,
                        });
                    }
                }
            }
            Op::SwapRoundTrip { id } => {
                out.push(Op::SwapOut { ids: vec![id] });
                out.push(Op::SwapIn { ids: vec![id] });
            }
            op => out.push(op),
        }
    }
    out
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let id = 0u64..5;
    let ids = proptest::collection::vec(0u64..5, 1..4);
    prop_oneof![
        5 => (id.clone(), 0usize..28, 0u32..3, prop_oneof![4 => Just(0u8), 1 => 1u8..3], prop_oneof![4 => Just(0u8), 1 => 1u8..3])
            .prop_map(|(id, len, family, salt, lora)| Op::Add { id, len, family, salt, lora }),
        2 => (id.clone(), 0usize..12, 0usize..3).prop_map(|(id, new, la)| Op::Allocate { id, new, la }),
        6 => (id.clone(), prop_oneof![3 => Just(0usize), 1 => 1usize..4]).prop_map(|(id, la)| Op::AllocateRest { id, la }),
        1 => (ids.clone(), proptest::collection::vec(-1i64..4, 4), 0usize..2)
            .prop_map(|(ids, new, la)| Op::AllocateBatch { ids, new, la }),
        2 => (id.clone(), 0usize..10, proptest::collection::vec(0u32..50, 0..3))
            .prop_map(|(id, n, toks)| Op::Commit { id, n, toks }),
        6 => (id.clone(), 0u32..50).prop_map(|(id, tok)| Op::CommitAll { id, tok }),
        1 => (ids.clone(), proptest::collection::vec(-1i64..3, 4), proptest::collection::vec(-1i64..50, 4))
            .prop_map(|(ids, n, toks)| Op::CommitBatch { ids, n, toks }),
        3 => (id.clone(), id.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        3 => id.clone().prop_map(|id| Op::Free { id }),
        2 => ids.clone().prop_map(|ids| Op::SwapOut { ids }),
        2 => ids.clone().prop_map(|ids| Op::SwapIn { ids }),
        2 => ids.prop_map(|ids| Op::Refresh { ids }),
        1 => (id.clone(), 0usize..6).prop_map(|(id, la)| Op::CanAllocate { id, la }),
        1 => Just(Op::Reset),
        6 => (id.clone(), 1usize..28, 0u32..3).prop_map(|(id, len, family)| Op::Prefill { id, len, family }),
        4 => (id.clone(), 1usize..6).prop_map(|(id, steps)| Op::Decode { id, steps }),
        3 => (id.clone(), id.clone(), 1usize..4)
            .prop_map(|(parent, child, steps)| Op::ForkDecode { parent, child, steps }),
        2 => id.prop_map(|id| Op::SwapRoundTrip { id }),
    ]
}

fn config_strategy() -> impl Strategy<Value = ManagerConfig> {
    (
        4usize..32,
        prop_oneof![1 => Just(1usize), 2 => Just(2), 4 => Just(4)],
        prop_oneof![1 => Just(0usize), 3 => 1usize..16],
        prop_oneof![4 => Just(true), 1 => Just(false)],
        any::<bool>(),
        prop_oneof![Just(0.0), Just(0.1)],
        prop_oneof![3 => Just(None), 1 => (1usize..10).prop_map(Some)],
    )
        .prop_map(|(nb, bs, cpu, caching, xxh, wm, window)| {
            let mut c = ManagerConfig::new(nb, bs);
            c.num_cpu_blocks = cpu;
            c.enable_prefix_caching = caching;
            c.hash_algo = if xxh {
                HashAlgo::Xxh3_128
            } else {
                HashAlgo::Blake3
            };
            c.watermark = wm;
            c.sliding_window = window;
            c
        })
}

fn family_tokens(family: u32, len: usize) -> Vec<u32> {
    // Families share prefixes with each other in their first few tokens so that cache
    // hits, partial hits and misses all happen.
    (0..len as u32)
        .map(|i| if i < 8 { i } else { family * 1000 + i })
        .collect()
}

fn ok_kind<T>(r: Result<T, KvError>) -> Result<T, Kind> {
    r.map_err(|e| kind(&e))
}

fn compare(m: &mut KVCacheManager, model: &mut Model) {
    m.check_invariants().expect("invariants");
    assert_eq!(
        m.free_block_ids(),
        model.free.iter().copied().collect::<Vec<_>>(),
        "GPU free queue"
    );
    assert_eq!(
        m.free_cpu_block_ids(),
        model.cpu_free.iter().copied().collect::<Vec<_>>(),
        "CPU free queue"
    );
    assert_eq!(m.seq_ids(), model.seqs.keys().copied().collect::<Vec<_>>());
    for (&id, s) in &model.seqs {
        assert_eq!(m.num_tokens(id).unwrap(), s.tokens.len());
        assert_eq!(
            m.num_computed_tokens(id).unwrap(),
            model.computed_of(s),
            "computed of {id}"
        );
        assert_eq!(m.is_swapped(id).unwrap(), s.swapped);
        let cached = if s.allocated {
            s.cached_tokens
        } else {
            model.computed_of(s)
        };
        assert_eq!(m.num_cached_tokens(id).unwrap(), cached);
        if !s.swapped {
            let t: Vec<i32> = s.table.iter().map(|&b| b as i32).collect();
            assert_eq!(m.block_table(id).unwrap(), t, "table of {id}");
        }
    }
    assert_eq!(m.take_copy_on_writes(), std::mem::take(&mut model.cow));
    assert_eq!(m.take_events(), std::mem::take(&mut model.events));
    let st = m.stats();
    let c = &model.c;
    assert_eq!(
        (
            st.prefix_cache_queries,
            st.prefix_cache_hits,
            st.evictions,
            st.cow_copies,
            st.blocks_swapped_out,
            st.blocks_swapped_in
        ),
        (c.queries, c.hits, c.evictions, c.cow, c.out, c.inn)
    );
    assert_eq!(st.num_cached_blocks, model.map.len());
    assert_eq!(
        st.num_swapped_sequences,
        model.seqs.values().filter(|s| s.swapped).count()
    );
}

fn run(config: ManagerConfig, ops: Vec<Op>) -> Coverage {
    let mut cov = Coverage::default();
    let mut m = KVCacheManager::new(config.clone()).unwrap();
    let mut model = Model::new(&config);
    for op in expand(ops) {
        let before = m.clone();
        let failed = match &op {
            Op::Add {
                id,
                len,
                family,
                salt,
                lora,
            } => {
                let t = family_tokens(*family, *len);
                let salt: Option<&[u8]> = match salt {
                    0 => None,
                    1 => Some(b""),
                    _ => Some(b"s"),
                };
                let lora = match lora {
                    0 => None,
                    l => Some(*l as u64 - 1),
                };
                let a = ok_kind(m.add_sequence(*id, &t, salt, lora));
                assert_eq!(a, model.add(*id, &t, salt, lora), "{op:?}");
                a.is_err()
            }
            Op::Allocate { id, new, la } => {
                let a = ok_kind(m.allocate_slots(*id, *new, *la));
                assert_eq!(a, model.allocate(*id, *new, *la), "{op:?}");
                !matches!(a, Ok(Some(_)))
            }
            Op::AllocateRest { id, la } => {
                let new = model
                    .seqs
                    .get(id)
                    .map_or(0, |s| s.tokens.len() - model.computed_of(s));
                let a = ok_kind(m.allocate_slots(*id, new, *la));
                assert_eq!(a, model.allocate(*id, new, *la), "{op:?}");
                !matches!(a, Ok(Some(_)))
            }
            Op::AllocateBatch { ids, new, la } => {
                let new = &new[..ids.len()];
                let a = ok_kind(m.allocate_slots_batch(ids, BatchArg::Each(new), *la));
                assert_eq!(a, model.allocate_batch(ids, new, *la), "{op:?}");
                a.is_err()
            }
            Op::Commit { id, n, toks } => {
                let a = ok_kind(m.commit(*id, *n, toks));
                assert_eq!(a, model.commit(*id, *n, toks), "{op:?}");
                a.is_err()
            }
            Op::CommitAll { id, tok } => {
                let n = model.seqs.get(id).map_or(0, |s| {
                    s.reserved.unwrap_or(s.computed).min(s.tokens.len()) - s.computed
                });
                let a = ok_kind(m.commit(*id, n, &[*tok]));
                assert_eq!(a, model.commit(*id, n, &[*tok]), "{op:?}");
                a.is_err()
            }
            Op::CommitBatch { ids, n, toks } => {
                let (n, toks) = (&n[..ids.len()], &toks[..ids.len()]);
                let a = ok_kind(m.commit_batch(ids, BatchArg::Each(n), Some(BatchArg::Each(toks))));
                assert_eq!(a, model.commit_batch(ids, n, toks), "{op:?}");
                a.is_err()
            }
            Op::Fork { parent, child } => {
                let a = ok_kind(m.fork(*parent, *child));
                assert_eq!(a, model.fork(*parent, *child), "{op:?}");
                a.is_err()
            }
            Op::Free { id } => {
                let a = ok_kind(m.free(*id));
                assert_eq!(a, model.free_seq(*id), "{op:?}");
                a.is_err()
            }
            Op::SwapOut { ids } => {
                let can = ok_kind(m.can_swap_out(ids));
                let a = ok_kind(m.swap_out(ids));
                assert_eq!(a, model.swap_out(ids), "{op:?}");
                match can {
                    Ok(c) => assert_eq!(c, a.is_ok()),
                    Err(k) => assert_eq!(a, Err(k)),
                }
                a.is_err()
            }
            Op::SwapIn { ids } => {
                let can = ok_kind(m.can_swap_in(ids));
                let a = ok_kind(m.swap_in(ids));
                assert_eq!(a, model.swap_in(ids), "{op:?}");
                match can {
                    Ok(true) => assert!(a.is_ok()),
                    Ok(false) => {}
                    Err(k) => assert_eq!(a, Err(k)),
                }
                a.is_err()
            }
            Op::CanAllocate { id, la } => {
                let a = ok_kind(m.can_allocate(*id, *la));
                assert_eq!(a, model.can_allocate(*id, *la), "{op:?}");
                true
            }
            Op::Refresh { ids } => {
                let a = ok_kind(m.refresh_prefixes(ids));
                let b = model.refresh(ids);
                assert_eq!(a, b, "{op:?}");
                a.is_err()
            }
            Op::Reset => {
                let a = m.reset_prefix_cache();
                assert_eq!(a, model.reset(), "{op:?}");
                !a
            }
            Op::Prefill { .. }
            | Op::Decode { .. }
            | Op::ForkDecode { .. }
            | Op::SwapRoundTrip { .. } => unreachable!("expanded"),
        };
        if failed {
            assert!(m == before, "failing or read-only {op:?} changed the state");
        }
        cov.observe(&m, &model, &op, failed);
        compare(&mut m, &mut model);
    }
    for id in model.seqs.keys().copied().collect::<Vec<_>>() {
        m.free(id).unwrap();
        model.free_seq(id).unwrap();
        compare(&mut m, &mut model);
    }
    assert_eq!(m.num_free_blocks(), config.num_blocks - 1);
    assert_eq!(m.num_free_cpu_blocks(), config.num_cpu_blocks);
    cov
}

/// How often the random runs reach the states worth testing.
#[derive(Debug, Default)]
struct Coverage {
    prefix_hits: u64,
    evictions: u64,
    cow_copies: u64,
    swaps_out: u64,
    swaps_in: u64,
    window_releases: u64,
    none_allocations: u64,
    successful_forks: u64,
    resets: u64,
}

impl Coverage {
    fn observe(&mut self, m: &KVCacheManager, model: &Model, op: &Op, failed: bool) {
        let st = m.stats();
        self.prefix_hits = self.prefix_hits.max(st.prefix_cache_hits);
        self.evictions = self.evictions.max(st.evictions);
        self.cow_copies = self.cow_copies.max(st.cow_copies);
        self.swaps_out = self.swaps_out.max(st.blocks_swapped_out);
        self.swaps_in = self.swaps_in.max(st.blocks_swapped_in);
        self.window_releases += model.seqs.values().any(|s| s.released > 0) as u64;
        match op {
            Op::Allocate { .. } | Op::AllocateRest { .. } if failed => self.none_allocations += 1,
            Op::Fork { .. } if !failed => self.successful_forks += 1,
            Op::Reset if !failed => self.resets += 1,
            _ => {}
        }
    }

    fn add(&mut self, o: &Coverage) {
        self.prefix_hits += (o.prefix_hits > 0) as u64;
        self.evictions += (o.evictions > 0) as u64;
        self.cow_copies += (o.cow_copies > 0) as u64;
        self.swaps_out += (o.swaps_out > 0) as u64;
        self.swaps_in += (o.swaps_in > 0) as u64;
        self.window_releases += (o.window_releases > 0) as u64;
        self.none_allocations += (o.none_allocations > 0) as u64;
        self.successful_forks += (o.successful_forks > 0) as u64;
        self.resets += (o.resets > 0) as u64;
    }
}

/// The generators must reach every interesting state in a good share of runs, or the
/// model test above proves little.
#[test]
fn random_runs_reach_interesting_states() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = (
        config_strategy(),
        proptest::collection::vec(op_strategy(), 1..60),
    );
    let mut total = Coverage::default();
    let runs = 200;
    for _ in 0..runs {
        let (config, ops) = strategy.new_tree(&mut runner).unwrap().current();
        total.add(&run(config, ops));
    }
    eprintln!("runs with each state out of {runs}: {total:?}");
    let c = &total;
    for (name, n) in [
        ("prefix hits", c.prefix_hits),
        ("evictions", c.evictions),
        ("cow copies", c.cow_copies),
        ("swap out", c.swaps_out),
        ("swap in", c.swaps_in),
        ("window releases", c.window_releases),
        ("allocations refused", c.none_allocations),
        ("forks", c.successful_forks),
        ("cache resets", c.resets),
    ] {
        assert!(n >= runs / 20, "only {n} of {runs} runs reach {name}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn manager_matches_reference_model(
        config in config_strategy(),
        ops in proptest::collection::vec(op_strategy(), 1..60),
    ) {
        run(config, ops);
    }
}
