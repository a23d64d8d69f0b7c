//! What a round holds under the K/V budget: admission and preemption.
//!
//! Rows take K/V blocks as they grow; nothing is reserved for a request's worst case. A
//! queued request is admitted when the budget holds what admitted rows hold now (shared
//! blocks once), what their prompts still need, one verify window more for every decoding
//! row, the blocks of its own prompt that the prefix cache does not hold, and a watermark
//! of headroom (a block for each row that will grow past its blocks, within a tenth of the
//! budget) so that admission does not fill the budget only to preempt at the next block
//! boundary. Before each
//! round, when the budget cannot hold the round's growth, blocks that only the prefix
//! cache holds are evicted, then the newest admitted request is preempted: its blocks are
//! freed and it goes back to the front of the queue, to recompute its prompt and the
//! tokens it had emitted when it resumes. Recomputed K/V are the same bytes (a block's K/V
//! is a pure function of the prefix it ends, docs/design.md), and its drafter is given the
//! same tokens again, so a resumed row goes on with the bits it would have had. A request
//! whose worst case exceeds the whole budget is refused at submit, so the oldest row can
//! always finish alone.

use mtp_constraint::Guide;
use mtp_drafter::Commit;
use mtp_model::Hidden;

use super::{Engine, Held, Row};
use crate::prefill::{Prompt, Scoring};
use crate::request::{Event, Request, RequestId};

/// A request waiting for admission: new, or preempted.
pub(super) struct Queued {
    pub id: RequestId,
    /// A preempted row's request holds the tokens to recompute as its prompt.
    pub request: Request,
    pub guide: Option<Guide>,
    /// A preempted decoding row (its cache emptied): it resumes where it stopped.
    pub resumes: Option<Box<Row>>,
    /// Its `Event::Admitted` went out already.
    pub admitted_before: bool,
}

impl Queued {
    pub fn new(id: RequestId, request: Request, guide: Option<Guide>) -> Queued {
        Queued { id, request, guide, resumes: None, admitted_before: false }
    }
}

impl Engine<'_> {
    /// Target K/V bytes of one block (every layer's K and V for its positions).
    fn block_bytes(&self) -> usize {
        self.model.kv_bytes_per_token().saturating_mul(self.block_positions)
    }

    /// Bytes of the blocks a row holding `from` positions adds to hold `to`, `copies`
    /// blocks it copies on write (a shared block it writes into) and its drafter's K/V.
    fn growth(&self, from: usize, to: usize, copies: usize) -> usize {
        let bp = self.block_positions;
        let blocks = to.div_ceil(bp).saturating_sub(from.div_ceil(bp)).saturating_add(copies);
        let drafter = self.drafter.as_ref().map_or(0, |d| d.kv_bytes_per_token());
        blocks
            .saturating_mul(self.block_bytes())
            .saturating_add(to.saturating_sub(from).saturating_mul(drafter))
    }

    /// Blocks a row of `len` positions copies when it next writes: its partly filled last
    /// block, when that one is `shared`.
    fn tail_copy(&self, len: usize, shared: bool) -> usize {
        (shared && !len.is_multiple_of(self.block_positions)) as usize
    }

    /// Bytes a prompt holding `from` of its `len` positions adds through its first verify:
    /// the rest of its blocks, a copy of the partly filled block it loaded when shared, and
    /// a copy of its own last block, which the prefix cache then shares, at its first
    /// verify (its window's positions too).
    fn prompt_growth(&self, from: usize, len: usize, loaded_shared: bool) -> usize {
        let copies = self.tail_copy(from, loaded_shared) + self.tail_copy(len, self.prefix.is_some());
        self.growth(from, len.saturating_add(self.window(true)), copies)
    }

    /// Positions a row adds in one round at most: its verify window (the pending token and
    /// drafts, when `drafting`).
    fn window(&self, drafting: bool) -> usize {
        let k = if drafting && self.drafter.is_some() { self.opts.k.max() } else { 0 };
        k + 1
    }

    /// Bytes the admitted requests need through the next round: what they hold (the prefix
    /// cache's blocks included, each block once), the rest of their prompts, and a verify
    /// window for every decoding row.
    fn projected(&self) -> usize {
        let Held { bytes, .. } = self.held();
        let drafter = self.drafter.as_ref().map_or(0, |d| d.kv_bytes_per_token());
        let positions: usize =
            self.prompts.iter().map(|p| p.cache.len()).chain(self.active.iter().map(|r| r.cache.len())).sum();
        let prompts: usize = self
            .prompts
            .iter()
            .map(|p| self.prompt_growth(p.cache.len(), p.request.prompt.len(), p.cache.last_block_shared()))
            .sum();
        let rows: usize = self
            .active
            .iter()
            .map(|r| {
                let (len, copies) =
                    (r.cache.len(), self.tail_copy(r.cache.len(), r.cache.last_block_shared()));
                self.growth(len, len + self.window(r.drafting), copies)
            })
            .sum();
        bytes.saturating_add(positions.saturating_mul(drafter)).saturating_add(prompts).saturating_add(rows)
    }

    /// Bytes a queued request's prompt takes on admission: the blocks the prefix cache does
    /// not hold (and the copy of a shared partial block), a row's fixed K/V.
    fn admission_need(&self, q: &Queued) -> usize {
        let want_hidden = self.drafter.as_ref().is_some_and(|d| d.hidden().wanted());
        let cached = self.prefix.as_ref().map_or(0, |p| p.cached_positions(&q.request.prompt, want_hidden));
        self.prompt_growth(cached, q.request.prompt.len(), true).saturating_add(self.model.kv_bytes_per_row())
    }

    /// Headroom admission leaves the admitted rows to grow into before one must be
    /// preempted: a block for each row (the newcomer `q` included) that will need more
    /// blocks than it holds through the next round, within a tenth of the budget; none
    /// while nothing is admitted (the oldest request always runs).
    fn watermark(&self, q: &Queued) -> usize {
        let Some(budget) = self.opts.kv_budget_bytes else { return 0 };
        if self.active.is_empty() && self.prompts.is_empty() || crate::negative_control::no_watermark() {
            return 0;
        }
        let bp = self.block_positions;
        let cap = self.model.max_positions();
        // Whether a row `len` long a round from now grows past that to `worst`.
        let grows = |len: usize, worst: usize| worst.min(cap).div_ceil(bp) > len.div_ceil(bp);
        let end = |prompt: usize, max_tokens: usize, drafting: bool| {
            prompt.saturating_add(max_tokens).saturating_add(self.window(drafting))
        };
        // A request whose prompt goes in (admitted or the newcomer).
        let prompt_grows =
            |r: &Request| grows(r.prompt.len() + self.window(true), end(r.prompt.len(), r.max_tokens, true));
        let rows = self
            .active
            .iter()
            .filter(|r| {
                grows(r.cache.len() + self.window(r.drafting), end(r.prompt_len, r.max_tokens, r.drafting))
            })
            .count()
            + self.prompts.iter().filter(|p| prompt_grows(&p.request)).count()
            + usize::from(prompt_grows(&q.request));
        self.block_bytes().saturating_mul(rows).min(budget / 10)
    }

    /// Bytes over the budget if `more` were added to what is projected (0 when it fits).
    fn over_budget(&self, more: usize) -> usize {
        self.opts.kv_budget_bytes.map_or(0, |b| self.projected().saturating_add(more).saturating_sub(b))
    }

    /// Moves queued requests in while the batch and the KV budget have room, oldest first
    /// (preempted ones are at the front); each loads its longest cached prefix, and its
    /// prompt goes in by [`Engine::take_pieces`]. A request that shares a prefix with an
    /// admitted prompt still computing it waits ([`Engine::waits_for_prefix`]); later ones
    /// may go first. Cached prefixes yield to what admission needs.
    pub(super) fn admit(&mut self, events: &mut Vec<Event>) {
        while self.active.len() + self.prompts.len() < self.opts.max_batch {
            let ready =
                |q: &Queued| q.request.prompt_logprobs.is_some() || !self.waits_for_prefix(&q.request.prompt);
            let Some(at) = self.queue.iter().position(ready) else {
                break;
            };
            let q = &self.queue[at];
            let over = self.over_budget(self.admission_need(q).saturating_add(self.watermark(q)));
            if over > 0 {
                if self.prefix.as_mut().is_some_and(|p| p.evict_unshared(over) > 0) {
                    continue;
                }
                break; // waits for running rows to free blocks
            }
            let q = self.queue.remove(at).expect("found above");
            if !q.admitted_before {
                events.push(Event::Admitted { request: q.id });
            }
            let prompt = self.prompt(q);
            self.prompts.push_back(prompt);
        }
    }

    /// A queued request as an admitted prompt, its cached prefix loaded.
    fn prompt(&mut self, q: Queued) -> Prompt {
        let t0 = std::time::Instant::now();
        let mut cache = self.model.new_cache();
        let drafting = q.resumes.as_ref().is_none_or(|r| r.drafting);
        let want_hidden = match &self.drafter {
            Some(d) if drafting => d.hidden(),
            _ => Hidden::None,
        };
        // A scored prompt reads every position's logits, so it computes them all.
        let scored = q.resumes.is_none() && q.request.prompt_logprobs.is_some();
        let (reused, hidden) = match self.prefix.as_mut().filter(|_| !scored) {
            Some(p) => p.load(&q.request.prompt, &mut cache, want_hidden.wanted()),
            None => (0, Vec::new()),
        };
        self.stats.prefill_time += t0.elapsed();
        // A greedy row that reports no alternatives and has no grammar reads the summary
        // alone; a resuming row reads nothing of its last forward.
        let r = &q.request;
        let full_logits =
            q.resumes.is_none() && (!r.sampling.is_greedy() || r.top_logprobs > 0 || q.guide.is_some());
        let scoring = r.prompt_logprobs.filter(|_| scored).map(Scoring::new);
        Prompt {
            id: q.id,
            request: q.request,
            guide: q.guide,
            cache,
            reused,
            hidden,
            want_hidden,
            full_logits,
            resumes: q.resumes,
            scoring,
        }
    }

    /// Frees room for the next round: blocks only the prefix cache holds, then the newest
    /// admitted requests, until the round fits the budget or one request is left.
    pub(super) fn make_room(&mut self) {
        loop {
            let over = self.over_budget(0);
            if over == 0 {
                return;
            }
            if self.prefix.as_mut().is_some_and(|p| p.evict_unshared(over) > 0) {
                continue;
            }
            if self.active.len() + self.prompts.len() <= 1 {
                return; // its worst case fits the budget (refused at submit otherwise)
            }
            self.preempt_newest();
        }
    }

    /// Frees the blocks of the admitted request that arrived last and queues it first.
    fn preempt_newest(&mut self) {
        let newest_prompt = self.prompts.iter().enumerate().max_by_key(|(_, p)| p.id).map(|(i, p)| (i, p.id));
        let newest_row = self.active.iter().enumerate().max_by_key(|(_, r)| r.id).map(|(i, r)| (i, r.id));
        let queued = match (newest_prompt, newest_row) {
            (Some((i, p)), row) if row.is_none_or(|(_, r)| p > r) => {
                let p = self.prompts.remove(i).expect("found");
                Queued {
                    id: p.id,
                    request: p.request,
                    guide: p.guide,
                    resumes: p.resumes,
                    admitted_before: true,
                }
            }
            (_, Some((i, _))) => {
                let row = self.active.remove(i);
                self.preempted(row)
            }
            _ => return,
        };
        self.stats.preemptions += 1;
        tracing::debug!(request = queued.id, "preempted: K/V budget full");
        self.queue.push_front(queued);
    }

    /// A decoding row as a queued request that recomputes its prompt and the tokens it
    /// emitted (all but the last, which its next verify runs).
    fn preempted(&mut self, mut row: Row) -> Queued {
        let mut tokens = row.prompt.clone();
        tokens.extend_from_slice(&row.tokens[..row.tokens.len() - 1]);
        if crate::negative_control::resume_one_position_short() {
            tokens.pop();
        }
        if let Some(d) = self.drafter.as_mut() {
            d.remove(row.id);
        }
        row.cache = self.model.new_cache();
        let request = Request { id: row.name.clone(), prompt: tokens, max_tokens: 1, ..Request::default() };
        Queued { id: row.id, request, guide: None, resumes: Some(Box::new(row)), admitted_before: true }
    }

    /// A preempted row whose tokens are back in its cache (`p`'s): it decodes again from
    /// its last emitted token, its drafter given the same tokens again.
    pub(super) fn resume(&mut self, mut row: Box<Row>, p: Prompt, hidden: &[f32]) {
        row.cache = p.cache;
        let next = *row.tokens.last().expect("a preempted row has emitted");
        let commit = Commit { start: 0, tokens: &p.request.prompt, hidden, next };
        self.drafter_commit(&mut row, commit);
        self.active.push(*row);
    }

    /// Whether `prompt` should wait in the queue for an admitted prompt that is still
    /// computing whole blocks of a prefix they share: it then loads them from the prefix
    /// cache instead of computing them a second time.
    pub(super) fn waits_for_prefix(&self, prompt: &[u32]) -> bool {
        if self.prefix.is_none() {
            return false;
        }
        self.prompts.iter().any(|p| {
            // One whole block past those `p` has computed, which this prompt could load (its
            // last token always runs): compared as slices, so a long queue stays cheap.
            let bt = p.cache.block_positions();
            let need = p.cache.len() / bt * bt + bt;
            need < prompt.len()
                && need <= p.request.prompt.len()
                && prompt[..need] == p.request.prompt[..need]
        })
    }
}
