//! Exact prefix cache: the K/V (and, for drafters that read them, the final hidden states)
//! of prompt prefixes, in the K/V store's blocks (`RowCache::block_positions` tokens each),
//! each keyed by the whole token prefix it ends: a trie of blocks, by chained hashes. A K/V
//! block is a pure function of its prefix (docs/design.md), so a row that adopts a cached
//! prefix and prefills only the rest holds the very bytes it would have computed: the
//! cache changes time to first token, never an output bit.
//!
//! Where the store pages (the CPU's host blocks, CUDA's device blocks), the cache holds the
//! row's blocks themselves, reference counted: a row that loads a prefix puts the same
//! blocks in its block table, so the prefix is held once however many rows read it, and a
//! row's writes never reach a shared block (copy-on-write, `mtp_cache::paged`). Other
//! stores (Metal's, tensor-parallel ranks') copy a block's bytes in and out. Evicting a block drops the cache's reference only, never
//! touching a running row; eviction is least recently used within a byte budget, children
//! before their parents, and the engine evicts blocks no row holds when rows need the
//! room ([`PrefixCache::evict_unshared`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};

use mtp_cache::{KvBlock, RowCache};

type Key = u64;

struct Block {
    parent: Option<Key>,
    /// The block's tokens: a whole block's, or fewer for a prompt's last block.
    tokens: Vec<u32>,
    /// The block's K/V: shared with the rows that hold it, or a copy of a row's bytes.
    kv: KvBlock,
    /// Final-normed hidden states of the block's positions (empty when not kept).
    hidden: Vec<f32>,
    stamp: u64,
    bytes: usize,
}

pub struct PrefixCache {
    /// Tokens per block: the rows' K/V block.
    block: usize,
    blocks: HashMap<Key, Block>,
    /// Each block's children (the root's under `None`): where a lookup ending inside a
    /// block looks.
    children: HashMap<Option<Key>, Vec<Key>>,
    by_stamp: BTreeMap<u64, Key>,
    clock: u64,
    budget: usize,
    used: usize,
}

/// A block's key: a hash of its parent's key and its tokens (the whole prefix, by chaining).
/// Lookups also compare the tokens and parent, so a hash collision can only miss, never
/// load the wrong bytes.
fn key(parent: Option<Key>, tokens: &[u32]) -> Key {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// A cached prefix found for a prompt: whole blocks, then possibly the first positions of
/// one more.
struct Found {
    keys: Vec<Key>,
    positions: usize,
}

impl PrefixCache {
    /// An empty cache of blocks of `block` tokens (the rows' `RowCache::block_positions`)
    /// that holds at most `budget` bytes.
    pub fn new(budget: usize, block: usize) -> PrefixCache {
        PrefixCache {
            block: block.max(1),
            blocks: HashMap::new(),
            children: HashMap::new(),
            by_stamp: BTreeMap::new(),
            clock: 0,
            budget,
            used: 0,
        }
    }

    /// Bytes held (K/V, hidden states and tokens), a block shared with rows included.
    pub fn bytes(&self) -> usize {
        self.used
    }

    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Calls `f(id, bytes)` for each K/V block held (the id its holders share).
    pub fn for_each_allocation(&self, f: &mut dyn FnMut(usize, usize)) {
        self.blocks.values().for_each(|b| f(b.kv.id(), b.kv.bytes()));
    }

    /// The longest cached prefix of `tokens`: whole blocks by their keys, then the cached
    /// child block sharing the most first tokens with what is left.
    fn matching(&self, tokens: &[u32], want_hidden: bool) -> Found {
        let usable = |b: &Block| !want_hidden || !b.hidden.is_empty();
        let mut keys = Vec::new();
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.block) {
            let k = key(parent, chunk);
            match self.blocks.get(&k) {
                Some(b) if b.parent == parent && b.tokens == chunk && usable(b) => {
                    keys.push(k);
                    parent = Some(k);
                }
                _ => break,
            }
        }
        let mut positions = keys.len() * self.block;
        let rest = &tokens[positions..];
        let partial = self.children.get(&parent).into_iter().flatten().filter_map(|k| {
            let b = self.blocks.get(k).filter(|b| b.parent == parent && usable(b))?;
            let shared = b.tokens.iter().zip(rest).take_while(|(a, b)| a == b).count();
            (shared > 0).then_some((shared, *k))
        });
        if let Some((shared, k)) = partial.max() {
            keys.push(k);
            positions += shared;
        }
        Found { keys, positions }
    }

    /// Loads into the empty `cache` the longest cached prefix of `prompt` that leaves at
    /// least one token to run (its logits are needed). Returns the positions loaded and,
    /// when `want_hidden`, their hidden states. A load that fails leaves `cache` empty.
    pub fn load(&mut self, prompt: &[u32], cache: &mut RowCache, want_hidden: bool) -> (usize, Vec<f32>) {
        let usable = prompt.len().saturating_sub(1);
        let found = self.matching(&prompt[..usable], want_hidden);
        if found.keys.is_empty() || !cache.is_empty() {
            return (0, Vec::new());
        }
        let n = found.positions;
        let mut blocks = Vec::with_capacity(found.keys.len());
        let mut hidden = Vec::new();
        for (i, k) in found.keys.iter().enumerate() {
            let b = &self.blocks[k];
            blocks.push(b.kv.clone());
            if want_hidden {
                let width = b.hidden.len() / b.tokens.len().max(1);
                let take = (n - i * self.block).min(b.tokens.len());
                hidden.extend_from_slice(&b.hidden[..take * width]);
            }
        }
        if let Err(e) = cache.adopt_blocks(&blocks, n) {
            tracing::warn!("prefix cache: cannot load {n} cached positions ({e}); recomputing them");
            return (0, Vec::new());
        }
        self.touch(&found.keys);
        (n, hidden)
    }

    /// Positions of `prompt` that [`PrefixCache::load`] would load now.
    pub fn cached_positions(&self, prompt: &[u32], want_hidden: bool) -> usize {
        self.matching(&prompt[..prompt.len().saturating_sub(1)], want_hidden).positions
    }

    /// Evicts least recently used blocks that no row holds too (so that dropping them frees
    /// memory) until `bytes` are freed or none is left; returns the bytes freed.
    pub fn evict_unshared(&mut self, bytes: usize) -> usize {
        let victims: Vec<Key> = self
            .by_stamp
            .values()
            .filter(|k| !self.blocks[*k].kv.is_shared())
            .scan(0usize, |freed, &k| {
                (*freed < bytes).then(|| {
                    *freed += self.blocks[&k].bytes;
                    k
                })
            })
            .collect();
        let mut freed = 0;
        for k in victims {
            let stamp = self.blocks[&k].stamp;
            self.by_stamp.remove(&stamp);
            freed += self.blocks[&k].bytes;
            self.remove(k);
        }
        freed
    }

    fn remove(&mut self, k: Key) {
        if let Some(b) = self.blocks.remove(&k) {
            self.used -= b.bytes;
            if let Some(siblings) = self.children.get_mut(&b.parent) {
                siblings.retain(|&c| c != k);
                if siblings.is_empty() {
                    self.children.remove(&b.parent);
                }
            }
        }
    }

    /// Keeps the blocks of `prompt` that this cache lacks (its last one even if partly
    /// filled), taken from `cache` (which holds at least the prompt's positions) and
    /// `hidden` (the prompt's hidden states, or empty), evicting least recently used
    /// blocks to stay within its budget and `limit`.
    pub fn insert(&mut self, prompt: &[u32], cache: &RowCache, hidden: &[f32], limit: usize) {
        let budget = self.budget.min(limit);
        let bt = self.block;
        let len = prompt.len().min(cache.len());
        let n_blocks = len.div_ceil(bt);
        let hidden_width = if prompt.is_empty() { 0 } else { hidden.len() / prompt.len() };
        // The row's blocks from the first one this cache lacks on, taken once.
        let mut shared: Option<(usize, Vec<KvBlock>)> = None;
        let mut path: Vec<Key> = Vec::new();
        let mut parent = None;
        for (i, chunk) in prompt[..len].chunks(bt).enumerate() {
            let k = key(parent, chunk);
            if let Some(b) = self.blocks.get(&k) {
                if b.parent != parent || b.tokens != chunk {
                    break; // a hash collision: leave this prefix uncached
                }
                path.push(k);
                parent = Some(k);
                continue;
            }
            if shared.is_none() {
                match cache.share_blocks(i, n_blocks - i) {
                    Ok(blocks) => shared = Some((i, blocks)),
                    Err(e) => {
                        tracing::warn!(
                            "prefix cache: cannot take a row's K/V blocks ({e}); not caching them"
                        );
                        break;
                    }
                }
            }
            let (first, blocks) = shared.as_ref().expect("taken above");
            let kv = blocks[i - first].clone();
            let hidden = if hidden_width > 0 {
                hidden[i * bt * hidden_width..(i * bt + chunk.len()) * hidden_width].to_vec()
            } else {
                Vec::new()
            };
            let bytes = kv.bytes() + 4 * (hidden.len() + chunk.len());
            if !self.make_room(bytes, budget, &path) {
                break;
            }
            self.clock += 1;
            let block = Block { parent, tokens: chunk.to_vec(), kv, hidden, stamp: self.clock, bytes };
            self.by_stamp.insert(self.clock, k);
            self.blocks.insert(k, block);
            self.children.entry(parent).or_default().push(k);
            self.used += bytes;
            path.push(k);
            parent = Some(k);
        }
        self.touch(&path);
    }

    /// Evicts least recently used blocks outside `keep` until `bytes` more fit in `budget`;
    /// false when they cannot.
    fn make_room(&mut self, bytes: usize, budget: usize, keep: &[Key]) -> bool {
        if bytes > budget {
            return false;
        }
        let keep: HashSet<Key> = keep.iter().copied().collect();
        while self.used + bytes > budget {
            let victim = self.by_stamp.iter().find(|(_, k)| !keep.contains(k)).map(|(&s, &k)| (s, k));
            let Some((stamp, k)) = victim else { return false };
            self.by_stamp.remove(&stamp);
            self.remove(k);
        }
        true
    }

    /// Marks a path of blocks (root first) as just used, the leaf oldest, so that eviction
    /// takes children before their parents.
    fn touch(&mut self, path: &[Key]) {
        for k in path.iter().rev() {
            let Some(b) = self.blocks.get_mut(k) else { continue };
            self.by_stamp.remove(&b.stamp);
            self.clock += 1;
            b.stamp = self.clock;
            self.by_stamp.insert(self.clock, *k);
        }
    }
}
