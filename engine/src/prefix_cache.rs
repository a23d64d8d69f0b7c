//! Exact prefix cache: the K/V (and, for drafters that read them, the final hidden states)
//! of prompt prefixes, in blocks of [`BLOCK_TOKENS`] tokens, each keyed by the whole token
//! prefix it ends. A K/V entry is a pure function of its prefix (docs/design.md), so a row that
//! loads a cached prefix and prefills only the rest holds the very bytes it would have
//! computed: the cache changes time to first token, never an output bit.
//!
//! Blocks are copied into a row's own cache on admission (rows never share storage, so a
//! block needs no reference count while rows run, and evicting one never touches a running
//! row); eviction is least recently used within a byte budget and within what the engine's
//! KV budget leaves after rows' reservations, children before their parents.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};

use mtp_cache::RowCache;

/// Tokens per cached block.
pub const BLOCK_TOKENS: usize = 16;

type Key = u64;

struct Block {
    parent: Option<Key>,
    tokens: Vec<u32>,
    /// Per layer, the block's K and V bytes as the row's store holds them.
    kv: Vec<(Vec<u8>, Vec<u8>)>,
    /// Final-normed hidden states of the block's positions (empty when not kept).
    hidden: Vec<f32>,
    stamp: u64,
    bytes: usize,
}

pub struct PrefixCache {
    blocks: HashMap<Key, Block>,
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

impl PrefixCache {
    /// An empty cache that holds at most `budget` bytes.
    pub fn new(budget: usize) -> PrefixCache {
        PrefixCache { blocks: HashMap::new(), by_stamp: BTreeMap::new(), clock: 0, budget, used: 0 }
    }

    /// Bytes held (K/V, hidden states and tokens).
    pub fn bytes(&self) -> usize {
        self.used
    }

    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Keys of the cached blocks that spell the longest block-aligned prefix of `tokens`.
    fn matching(&self, tokens: &[u32], want_hidden: bool) -> Vec<Key> {
        let mut keys = Vec::new();
        let mut parent = None;
        for chunk in tokens.chunks_exact(BLOCK_TOKENS) {
            let k = key(parent, chunk);
            match self.blocks.get(&k) {
                Some(b)
                    if b.parent == parent && b.tokens == chunk && (!want_hidden || !b.hidden.is_empty()) =>
                {
                    keys.push(k);
                    parent = Some(k);
                }
                _ => break,
            }
        }
        keys
    }

    /// Loads into the empty `cache` the longest cached prefix of `prompt` that leaves at
    /// least one token to run (its logits are needed). Returns the positions loaded and,
    /// when `want_hidden`, their hidden states. A load that fails leaves `cache` empty.
    pub fn load(&mut self, prompt: &[u32], cache: &mut RowCache, want_hidden: bool) -> (usize, Vec<f32>) {
        let usable = prompt.len().saturating_sub(1);
        let keys = self.matching(&prompt[..usable], want_hidden);
        if keys.is_empty() || !cache.is_empty() {
            return (0, Vec::new());
        }
        let mut kv: Vec<(Vec<u8>, Vec<u8>)> = vec![(Vec::new(), Vec::new()); cache.n_layers()];
        let mut hidden = Vec::new();
        for k in &keys {
            let b = &self.blocks[k];
            for ((k_all, v_all), (bk, bv)) in kv.iter_mut().zip(&b.kv) {
                k_all.extend_from_slice(bk);
                v_all.extend_from_slice(bv);
            }
            if want_hidden {
                hidden.extend_from_slice(&b.hidden);
            }
        }
        let n = keys.len() * BLOCK_TOKENS;
        if let Err(e) = cache.append_bytes(n, &kv) {
            tracing::warn!("prefix cache: cannot load {n} cached positions ({e}); recomputing them");
            return (0, Vec::new());
        }
        self.touch(&keys);
        (n, hidden)
    }

    /// Evicts least recently used blocks until at most `bytes` are held.
    pub fn evict_to(&mut self, bytes: usize) {
        while self.used > bytes {
            let Some((_, k)) = self.by_stamp.pop_first() else { return };
            if let Some(b) = self.blocks.remove(&k) {
                self.used -= b.bytes;
            }
        }
    }

    /// Keeps the full blocks of `prompt` that this cache lacks, read from `cache` (which
    /// holds at least the prompt's positions) and `hidden` (the prompt's hidden states, or
    /// empty), evicting least recently used blocks to stay within its budget and `limit`.
    pub fn insert(&mut self, prompt: &[u32], cache: &RowCache, hidden: &[f32], limit: usize) {
        let budget = self.budget.min(limit);
        let n_blocks = prompt.len().min(cache.len()) / BLOCK_TOKENS;
        let hidden_per_block = if prompt.is_empty() { 0 } else { hidden.len() / prompt.len() * BLOCK_TOKENS };
        let mut layers: Option<Vec<(Vec<u8>, Vec<u8>)>> = None;
        let mut path: Vec<Key> = Vec::new();
        let mut parent = None;
        for (i, chunk) in prompt.chunks_exact(BLOCK_TOKENS).take(n_blocks).enumerate() {
            let k = key(parent, chunk);
            if let Some(b) = self.blocks.get(&k) {
                if b.parent != parent || b.tokens != chunk {
                    break; // a hash collision: leave this prefix uncached
                }
                path.push(k);
                parent = Some(k);
                continue;
            }
            if layers.is_none() {
                let read: Result<Vec<_>, _> =
                    (0..cache.n_layers()).map(|l| cache.committed_bytes(l)).collect();
                match read {
                    Ok(l) => layers = Some(l),
                    Err(e) => {
                        tracing::warn!("prefix cache: cannot read a row's K/V ({e}); not caching it");
                        break;
                    }
                }
            }
            let all = layers.as_ref().expect("read above");
            let slot_bytes = all.first().map_or(0, |(k, _)| k.len() / cache.len().max(1));
            let range = i * BLOCK_TOKENS * slot_bytes..(i + 1) * BLOCK_TOKENS * slot_bytes;
            let kv: Vec<(Vec<u8>, Vec<u8>)> =
                all.iter().map(|(k, v)| (k[range.clone()].to_vec(), v[range.clone()].to_vec())).collect();
            let hidden = if hidden_per_block > 0 {
                hidden[i * hidden_per_block..(i + 1) * hidden_per_block].to_vec()
            } else {
                Vec::new()
            };
            let bytes =
                kv.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() + 4 * (hidden.len() + chunk.len());
            if !self.make_room(bytes, budget, &path) {
                break;
            }
            self.clock += 1;
            let block = Block { parent, tokens: chunk.to_vec(), kv, hidden, stamp: self.clock, bytes };
            self.by_stamp.insert(self.clock, k);
            self.blocks.insert(k, block);
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
            if let Some(b) = self.blocks.remove(&k) {
                self.used -= b.bytes;
            }
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
