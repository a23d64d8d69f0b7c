//! The round loop (see docs/design.md, "One round of the engine"):
//! admit and prefill newcomers (pieces of several prompts up to a token budget a forward:
//! alone when no row decodes, else beside the verify) -> propose drafts -> verify all rows in one forward ->
//! roll back target cache and drafter state -> emit tokens, retire finished rows.
//! Plain decoding is the same loop without a drafter (k = 0).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mtp_base::logits::top_logprobs;
use mtp_base::{Error, Tokenizer};
use mtp_cache::RowCache;
use mtp_constraint::{Grammars, Guide, TokenMask};
use mtp_drafter::{Commit, DraftAsk, Drafter, Proposal};
use mtp_model::{Hidden, Model, RowInput, RowOutput};
use mtp_sampling::{pick, SamplingMode, SamplingParams};
use mtp_verifier::{verify_beside, Verified, VerifyRow, WindowLayout};

use crate::adaptive::{Candidate, DraftLen, KChooser, Learned, Outcome};
use crate::guided::{first_masked, grammar_error, walk_masks};
use crate::metrics::SpecStats;
use crate::prefill::{piece_beside, Piece, Prefilled, Prompt};
use crate::prefix_cache::PrefixCache;
use crate::request::{Event, FinishReason, Request, RequestId};

mod scheduler;
use scheduler::Queued;

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Rows decoded together; further requests wait in a queue.
    pub max_batch: usize,
    /// Prompt tokens per forward: a token budget shared by pieces of several admitted
    /// prompts, oldest first. While other rows decode they run in the same forward as their
    /// verify, filling it up to this many tokens (at least half of them prompt): about what
    /// a decoding row's round carries.
    pub prefill_chunk: usize,
    /// Draft tokens per row per round (ignored without a drafter): fixed, or adaptive up
    /// to a maximum (the default).
    pub k: DraftLen,
    /// Where verify windows are written (results are identical either way).
    pub layout: WindowLayout,
    /// K/V bytes (target + drafter, the prefix cache's blocks included, a shared block
    /// once) that admitted requests may hold. Rows take blocks as they grow: a request is
    /// admitted when its prompt fits beside what the admitted rows need through the next
    /// round, and when a round does not fit, the newest admitted request is preempted (its
    /// blocks freed, its tokens recomputed when it resumes, with the same bits). A request
    /// whose worst case exceeds the whole budget is refused.
    pub kv_budget_bytes: Option<usize>,
    /// How rows at temperature > 0 judge drafts (greedy rows are unaffected).
    pub sampling_mode: SamplingMode,
    /// Bytes the exact prefix cache may hold (0: off): prompts that share a prefix with an
    /// earlier one load its K/V instead of recomputing them, with identical output bits.
    /// With a KV budget, blocks only the cache holds count in it too, and are evicted when
    /// rows need the room.
    pub prefix_cache_bytes: usize,
    /// What rows in rejection mode price one more verify token at, in decode steps of one
    /// row (their k may depend on their own history only, so it is a fixed figure). `None`:
    /// the backend's ([`mtp_model::Model::verify_token_cost`]: 1 on the CPU, a fifth on
    /// the GPUs); a large model on the CPU, whose steps stream its weights, may set less.
    pub verify_token_cost: Option<f64>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_batch: 8,
            prefill_chunk: 64,
            k: DraftLen::Adaptive(8),
            layout: WindowLayout::RowTail,
            kv_budget_bytes: None,
            sampling_mode: SamplingMode::Exact,
            prefix_cache_bytes: 0,
            verify_token_cost: None,
        }
    }
}

/// The target's K/V in use ([`Engine::kv_usage`]), read in one pass over the block tables.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvUsage {
    /// Physical bytes admitted rows hold ([`Engine::kv_bytes`]).
    pub bytes: usize,
    /// Allocations held by admitted rows and the prefix cache, a shared one once: blocks
    /// where the store pages, whole row buffers where it does not (Metal).
    pub blocks_used: usize,
    /// Blocks the KV budget still has room for (`None` without a budget).
    pub blocks_free: Option<usize>,
}

/// Distinct allocations counted once: those of admitted rows, then the prefix cache's too.
#[derive(Default)]
struct Held {
    row_bytes: usize,
    allocations: usize,
    bytes: usize,
}

pub(crate) struct Row {
    id: RequestId,
    name: String,
    cache: RowCache,
    /// The prompt (what a preempted row recomputes, with its emitted tokens).
    prompt: Vec<u32>,
    prompt_len: usize,
    /// Emitted tokens; the last one is not yet in `cache`.
    tokens: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    stop: Vec<String>,
    sampling: SamplingParams,
    top_logprobs: usize,
    /// False once the drafter failed on this row: it decodes plainly from then on.
    drafting: bool,
    /// Positions committed since the drafter last drafted for this row (what it must
    /// catch up on before its next draft).
    behind: usize,
    /// A constrained row's grammar state: it has consumed exactly `tokens`.
    guide: Option<Guide>,
}

pub struct Engine<'a> {
    model: &'a Model,
    drafter: Option<Box<dyn Drafter + 'a>>,
    tokenizer: Option<&'a Tokenizer>,
    /// Built from the tokenizer at the first constrained request (or its error).
    grammars: Option<Result<Arc<Grammars>, String>>,
    opts: EngineOptions,
    /// Waiting for admission: preempted requests first, then new ones in arrival order.
    queue: VecDeque<Queued>,
    /// Admitted, their prompts going into their caches, oldest first.
    prompts: VecDeque<Prompt>,
    active: Vec<Row>,
    outbox: Vec<Event>,
    next_id: RequestId,
    stats: SpecStats,
    chooser: KChooser,
    prefix: Option<PrefixCache>,
    /// Positions per K/V block of a row's cache (`RowCache::block_positions`).
    block_positions: usize,
}

impl<'a> Engine<'a> {
    /// An engine over `model`; with no drafter (or `k` = 0) it decodes plainly. Refuses
    /// options that cannot mean anything (`max_batch` or `prefill_chunk` of 0, `k` over
    /// [`MAX_DRAFT_TOKENS`](crate::MAX_DRAFT_TOKENS)).
    pub fn new(
        model: &'a Model,
        drafter: Option<Box<dyn Drafter + 'a>>,
        opts: EngineOptions,
    ) -> Result<Self, Error> {
        for (name, value) in [("max_batch", opts.max_batch), ("prefill_chunk", opts.prefill_chunk)] {
            if value == 0 {
                return Err(Error::InvalidOption(format!("engine option `{name}` must be at least 1")));
            }
        }
        if opts.k.max() > crate::MAX_DRAFT_TOKENS {
            return Err(Error::InvalidOption(format!(
                "engine option `k`: {} drafts a round, at most {} allowed",
                opts.k.max(),
                crate::MAX_DRAFT_TOKENS
            )));
        }
        if let Some(c) = opts.verify_token_cost.filter(|c| !(c.is_finite() && *c >= 0.0)) {
            return Err(Error::InvalidOption(format!(
                "engine option `verify_token_cost`: {c} decode steps; give a finite figure, 0 or more"
            )));
        }
        let chooser = KChooser::new(opts.k.max(), drafter.as_ref().map_or(0.0, |d| d.relative_cost()))
            .with_token_group(model.verify_token_group())
            .with_verify_token_cost(opts.verify_token_cost.unwrap_or_else(|| model.verify_token_cost()));
        // A sliding-window ring forgets old positions, so its rows cannot share a prefix.
        let probe = model.new_cache();
        let prefix_cache = opts.prefix_cache_bytes > 0 && !probe.has_ring();
        if opts.prefix_cache_bytes > 0 && !prefix_cache {
            tracing::info!("prefix cache off: this model keeps sliding-window layers in a ring");
        }
        Ok(Engine {
            model,
            drafter,
            tokenizer: None,
            grammars: None,
            queue: VecDeque::new(),
            prompts: VecDeque::new(),
            active: Vec::new(),
            outbox: Vec::new(),
            next_id: 0,
            stats: SpecStats::default(),
            chooser,
            prefix: prefix_cache.then(|| PrefixCache::new(opts.prefix_cache_bytes, probe.block_positions())),
            block_positions: probe.block_positions(),
            opts,
        })
    }

    /// Enables stop strings (decoded with this tokenizer).
    pub fn with_tokenizer(mut self, tokenizer: &'a Tokenizer) -> Self {
        self.tokenizer = Some(tokenizer);
        self
    }

    /// Completed rounds (each ran one verify forward).
    pub fn rounds(&self) -> u64 {
        self.stats.rounds
    }

    /// What adaptive k has learned so far (acceptance, costs), for a later engine of the
    /// same model and drafter to start from ([`Engine::with_learned`]) instead of from
    /// priors, as a long-lived engine does for each new request.
    pub fn learned(&self) -> Learned {
        self.chooser.learned()
    }

    /// Starts adaptive k from what an earlier engine learned ([`Engine::learned`]). Rows
    /// sampled in rejection mode ignore it: their k depends on their own history only.
    pub fn with_learned(mut self, learned: Learned) -> Self {
        self.chooser.resume(learned);
        self
    }

    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    /// Requests admitted: decoding, or their prompts going into their caches.
    pub fn running(&self) -> usize {
        self.active.len() + self.prompts.len()
    }

    /// Requests queued for admission.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Physical bytes of the target's K/V that admitted rows hold (open windows included),
    /// a block shared between rows counted once (blocks only the prefix cache holds are
    /// in [`Engine::prefix_cache_bytes`]).
    pub fn kv_bytes(&self) -> usize {
        self.held().row_bytes
    }

    /// The target's K/V in use: the rows' physical bytes, the allocations rows and the
    /// prefix cache hold, and how many more blocks the KV budget has room for.
    pub fn kv_usage(&self) -> KvUsage {
        let held = self.held();
        let block = self.model.kv_bytes_per_token().saturating_mul(self.block_positions);
        let blocks_free = self.opts.kv_budget_bytes.map(|b| b.saturating_sub(held.bytes) / block.max(1));
        KvUsage { bytes: held.row_bytes, blocks_used: held.allocations, blocks_free }
    }

    /// Distinct allocations (and their bytes) of admitted rows, then with the prefix
    /// cache's.
    fn held(&self) -> Held {
        let mut seen = std::collections::HashSet::new();
        let mut held = Held::default();
        let mut count = |held: &mut Held, id: usize, bytes: usize| {
            if seen.insert(id) {
                held.allocations += 1;
                held.bytes = held.bytes.saturating_add(bytes);
            }
        };
        for cache in self.prompts.iter().map(|p| &p.cache).chain(self.active.iter().map(|r| &r.cache)) {
            cache.for_each_allocation(&mut |id, bytes| count(&mut held, id, bytes));
        }
        held.row_bytes = held.bytes;
        if let Some(p) = self.prefix.as_ref() {
            p.for_each_allocation(&mut |id, bytes| count(&mut held, id, bytes));
        }
        held
    }

    /// Bytes the prefix cache holds (0 when it is off).
    pub fn prefix_cache_bytes(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.bytes())
    }

    /// No request waiting or running.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.prompts.is_empty() && self.active.is_empty() && self.outbox.is_empty()
    }

    fn per_token_bytes(&self) -> usize {
        self.model.kv_bytes_per_token() + self.drafter.as_ref().map_or(0, |d| d.kv_bytes_per_token())
    }

    /// Worst-case K/V bytes a request can hold (alone, nothing shared).
    fn worst_case(&self, r: &Request) -> usize {
        let k = if self.drafter.is_some() { self.opts.k.max() } else { 0 };
        // Saturating: `max_tokens` may be any usize (a client's u64::MAX must not wrap to a fit).
        let wanted = r.prompt.len().saturating_add(r.max_tokens).saturating_add(k + 1);
        let positions = wanted.min(self.model.max_positions().saturating_add(k + 1));
        positions.saturating_mul(self.per_token_bytes()).saturating_add(self.model.kv_bytes_per_row())
    }

    /// Queues a request; it is admitted at the start of a round when the batch and the
    /// KV budget have room. A request that can never run is refused here.
    pub fn submit(&mut self, r: Request) -> Result<RequestId, Error> {
        let err = |msg: String| Err(Error::Request { request: r.id.clone(), msg });
        let (vocab, context) = (self.model.config.vocab_size, self.model.max_positions());
        if r.prompt.is_empty() {
            return err("empty prompt".into());
        }
        if r.max_tokens == 0 && r.prompt_logprobs.is_none() {
            return err("max_tokens must be at least 1 (0 only when scoring the prompt)".into());
        }
        if let Some(t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            return err(format!("prompt token id {t} is outside the vocabulary of {vocab}"));
        }
        for (key, n) in [("top_logprobs", Some(r.top_logprobs)), ("prompt_logprobs", r.prompt_logprobs)] {
            if n.is_some_and(|n| n > vocab) {
                return err(format!(
                    "{key} of {} asks for more alternatives than the vocabulary's {vocab} tokens",
                    n.unwrap_or(0)
                ));
            }
        }
        if r.prompt.len() > context {
            return err(format!(
                "prompt of {} tokens does not fit the model's context of {context}",
                r.prompt.len()
            ));
        }
        if !r.stop.is_empty() && self.tokenizer.is_none() {
            return err("stop strings need a tokenizer (the target has no tokenizer.json)".into());
        }
        if r.stop.iter().any(|s| s.is_empty()) {
            return err("empty stop string".into());
        }
        if let Err(e) = r.sampling.validate() {
            return err(e.message);
        }
        let guide = match &r.constraint {
            None => None,
            Some(c) => match self.grammars().and_then(|g| g.compile(c)) {
                Ok(guide) => Some(guide),
                Err(msg) => return err(msg),
            },
        };
        if let Some(budget) = self.opts.kv_budget_bytes {
            let need = self.worst_case(&r);
            if need > budget {
                return err(format!(
                    "needs up to {:.1} MiB of KV cache ({} positions), more than the whole budget of {:.1} MiB",
                    need as f64 / 1048576.0,
                    (need - self.model.kv_bytes_per_row()) / self.per_token_bytes().max(1),
                    budget as f64 / 1048576.0
                ));
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push_back(Queued::new(id, r, guide));
        Ok(id)
    }

    /// The grammar compiler over the target's vocabulary, built once.
    fn grammars(&mut self) -> Result<Arc<Grammars>, String> {
        let Some(tok) = self.tokenizer else {
            return Err("constrained decoding needs a tokenizer (the target has no tokenizer.json)".into());
        };
        let config = &self.model.config;
        self.grammars
            .get_or_insert_with(|| {
                Grammars::new(tok, config.vocab_size, &config.eos_token_ids)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
    }

    /// Cancels a waiting or running request; its `Finished(Cancelled)` event comes with
    /// the next step. Returns false for an unknown or finished request.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.queue.iter().position(|q| q.id == id) {
            if let Some(row) = self.queue.remove(i).and_then(|q| q.resumes) {
                self.release(&row);
            }
        } else if let Some(i) = self.prompts.iter().position(|p| p.id == id) {
            if let Some(row) = self.prompts.remove(i).and_then(|p| p.resumes) {
                self.release(&row);
            }
        } else if let Some(i) = self.active.iter().position(|r| r.id == id) {
            let row = self.active.swap_remove(i);
            self.release(&row);
        } else {
            return false;
        }
        self.outbox.push(Event::Finished { request: id, reason: FinishReason::Cancelled });
        true
    }

    fn release(&mut self, row: &Row) {
        self.chooser.remove(row.id);
        if let Some(d) = self.drafter.as_mut() {
            d.remove(row.id);
        }
    }

    /// Runs one round and returns what happened, in order.
    pub fn step(&mut self) -> Vec<Event> {
        let mut events = std::mem::take(&mut self.outbox);
        self.admit(&mut events);
        self.make_room();
        if self.active.is_empty() {
            self.prefill_prompts(&mut events);
        }
        if !self.active.is_empty() {
            self.round(&mut events);
        }
        events
    }

    /// Admitted prompts into their caches while no row decodes: forwards of their pieces
    /// alone, several prompts a forward up to `prefill_chunk` tokens, until one starts
    /// decoding (the rest then go in beside the round's verify).
    fn prefill_prompts(&mut self, events: &mut Vec<Event>) {
        while self.active.is_empty() && !self.prompts.is_empty() {
            let t0 = Instant::now();
            let mut taken = self.take_pieces(self.opts.prefill_chunk, events);
            if taken.is_empty() {
                continue;
            }
            let mut inputs: Vec<RowInput> = taken.iter_mut().map(|(p, piece)| p.input(*piece)).collect();
            let outs = self.model.forward(&mut inputs);
            drop(inputs);
            self.stats.prefill_time += t0.elapsed();
            self.absorb_pieces(taken, outs, events);
        }
    }

    /// The round's prompt pieces: the waiting prompts', oldest first, each taking what it
    /// has left up to what `budget` tokens still hold (a token budget per forward, so a
    /// burst of arrivals goes in together instead of one prompt a round). A prompt whose
    /// K/V cannot be allocated fails here.
    fn take_pieces(&mut self, budget: usize, events: &mut Vec<Event>) -> Vec<(Prompt, Piece)> {
        let mut taken = Vec::new();
        let mut left = budget;
        while left > 0 {
            let Some(mut p) = self.prompts.pop_front() else { break };
            match p.next_piece(self.model, left) {
                Ok(piece) => {
                    left = left.saturating_sub(piece.len());
                    taken.push((p, piece));
                }
                Err(e) => self.prompt_advanced(p, Err(e), events),
            }
        }
        taken
    }

    /// Commits each taken piece's forward (`outs`, in order); prompts not done go back to
    /// the front of the line in their order, having shared their finished blocks.
    fn absorb_pieces(
        &mut self,
        taken: Vec<(Prompt, Piece)>,
        outs: Result<Vec<RowOutput>, Error>,
        events: &mut Vec<Event>,
    ) {
        let outs: Vec<Result<RowOutput, Error>> = match outs {
            Ok(o) => o.into_iter().map(Ok).collect(),
            Err(e) => taken.iter().map(|_| Err(Error::Backend(e.to_string()))).collect(),
        };
        let mut unfinished = Vec::new();
        for ((mut p, piece), out) in taken.into_iter().zip(outs) {
            match p.absorb(piece, out) {
                Ok(None) => {
                    self.share_progress(&p);
                    unfinished.push(p);
                }
                advanced => self.prompt_advanced(p, advanced, events),
            }
        }
        for p in unfinished.into_iter().rev() {
            self.prompts.push_front(p);
        }
    }

    /// Puts the whole blocks a prompt has computed so far in the prefix cache, so that
    /// prompts waiting on the same prefix ([`Engine::waits_for_prefix`]) load them.
    fn share_progress(&mut self, p: &Prompt) {
        let room = self.prefix_limit();
        let Some(prefix) = self.prefix.as_mut() else { return };
        let n = p.cache.len() / p.cache.block_positions() * p.cache.block_positions();
        if n == 0 {
            return;
        }
        let width = p.hidden.len() / p.cache.len().max(1);
        prefix.insert(&p.request.prompt[..n], &p.cache, &p.hidden[..(n * width).min(p.hidden.len())], room);
    }

    /// Bytes the prefix cache may hold besides its own budget: the KV budget (blocks only it
    /// holds are evicted first when rows need room, [`Engine::make_room`]).
    fn prefix_limit(&self) -> usize {
        self.opts.kv_budget_bytes.unwrap_or(usize::MAX)
    }

    /// What a prompt's forward left: nothing yet (it stays first in line), its whole
    /// prompt (it starts decoding, or a preempted row resumes) or an error (it fails).
    fn prompt_advanced(
        &mut self,
        p: Prompt,
        advanced: Result<Option<Prefilled>, Error>,
        events: &mut Vec<Event>,
    ) {
        match advanced {
            Ok(None) => self.prompts.push_front(p),
            Ok(Some(prefilled)) => self.start(p, prefilled, events),
            Err(e) => {
                if let Some(row) = &p.resumes {
                    self.release(row);
                }
                events.push(Event::Failed { request: p.id, error: with_request(e, &p.request.id) });
            }
        }
    }

    /// A prompt wholly in its cache: its first token, then a decoding row (or its end).
    fn start(&mut self, mut p: Prompt, last: Prefilled, events: &mut Vec<Event>) {
        if let Some(row) = p.resumes.take() {
            return self.resume(row, p, &last.hidden);
        }
        if let Some(scores) = p.take_scores() {
            events.push(Event::PromptScored { request: p.id, scores });
        }
        let Prompt { id, request: r, guide, cache, reused, .. } = p;
        self.stats.prompt_tokens += r.prompt.len() as u64;
        self.stats.prompt_tokens_cached += reused as u64;
        let hidden = &last.hidden;
        let room = self.prefix_limit();
        if let Some(prefix) = self.prefix.as_mut() {
            prefix.insert(&r.prompt, &cache, hidden, room);
        }
        if r.max_tokens == 0 {
            // Only scored (submit refuses 0 otherwise).
            events.push(Event::Finished { request: id, reason: FinishReason::Length });
            return;
        }
        let mut row = Row {
            id,
            name: r.id,
            cache,
            prompt: Vec::new(),
            prompt_len: r.prompt.len(),
            tokens: Vec::new(),
            max_tokens: r.max_tokens,
            ignore_eos: r.ignore_eos,
            stop: r.stop,
            sampling: r.sampling,
            top_logprobs: r.top_logprobs,
            drafting: self.drafter.is_some(),
            behind: r.prompt.len(),
            guide,
        };
        let first =
            match row.guide.as_mut().map(|g| first_masked(g, &last.logits, &r.sampling, row.prompt_len)) {
                None if r.sampling.is_greedy() => Ok((last.summary.argmax, None)),
                None => Ok((pick(&last.logits, &r.sampling, r.prompt.len() as u64), None)),
                Some(picked) => picked,
            };
        let (first, grammar_end) = match first {
            Ok(f) => f,
            Err(msg) => {
                events.push(Event::Failed { request: id, error: grammar_error(&row.name, msg) });
                self.release(&row);
                return;
            }
        };
        // Logprobs stay the target's unmasked log-softmax.
        let logprob = if r.sampling.is_greedy() && row.guide.is_none() {
            last.summary.argmax_logprob()
        } else {
            last.summary.logprob(last.logits[first as usize])
        };
        if let Err(e) = self.sane(&[first], &[logprob], row.prompt_len, &row.name) {
            events.push(Event::Failed { request: id, error: e });
            self.release(&row);
            return;
        }
        let top = vec![top_logprobs(&last.logits, &last.summary, row.top_logprobs)];
        if let Some(reason) = self.emit(&mut row, &[first], &[logprob], top, grammar_end, events) {
            events.push(Event::Finished { request: id, reason });
            self.release(&row);
            return;
        }
        let commit = Commit { start: 0, tokens: &r.prompt, hidden, next: first };
        self.drafter_commit(&mut row, commit);
        row.prompt = r.prompt;
        self.active.push(row);
    }

    fn drafter_commit(&mut self, row: &mut Row, c: Commit) {
        let Some(d) = self.drafter.as_mut() else { return };
        if !row.drafting {
            return;
        }
        if let Err(e) = d.commit(row.id, c) {
            tracing::warn!(request = %row.name, "drafter: {e}; decoding this row without drafts");
            d.remove(row.id);
            row.drafting = false;
        }
    }

    /// Refuses a row's new tokens when one means nothing: its logprob is not finite (the
    /// target's logits held a NaN or an infinity: bad weights or overflowing activations),
    /// or the tokenizer has no text for it (a padding row of the vocabulary). `first` is
    /// the position the first token takes.
    fn sane(&self, tokens: &[u32], logprobs: &[f32], first: usize, name: &str) -> Result<(), Error> {
        let err = |msg: String| Err(Error::Request { request: name.to_string(), msg });
        if let Some(j) = logprobs.iter().position(|l| !l.is_finite()) {
            return err(format!(
                "the model's logits are not finite at position {} (NaN or infinite values in the \
                 checkpoint's weights or activations); the request is ended",
                first + j
            ));
        }
        let Some(tok) = self.tokenizer else { return Ok(()) };
        if let Some(j) = tokens.iter().position(|&t| !tok.has_id(t)) {
            return err(format!(
                "the model chose token id {} at position {}, which {} has no text for (the \
                 vocabulary is padded past the tokenizer); the request is ended",
                tokens[j],
                first + j,
                tok.path().display()
            ));
        }
        Ok(())
    }

    /// Appends tokens to a row until one finishes it; returns why it finished.
    /// `grammar_end`: the row's constraint is complete after that many of `tokens`.
    fn emit(
        &self,
        row: &mut Row,
        tokens: &[u32],
        logprobs: &[f32],
        tops: Vec<Vec<(u32, f32)>>,
        grammar_end: Option<usize>,
        events: &mut Vec<Event>,
    ) -> Option<FinishReason> {
        let eos = &self.model.config.eos_token_ids;
        let mut tops = tops.into_iter();
        for (i, (&token, &logprob)) in tokens.iter().zip(logprobs).enumerate() {
            row.tokens.push(token);
            let top = tops.next().unwrap_or_default();
            events.push(Event::Token { request: row.id, token, logprob, top });
            if !row.ignore_eos && eos.contains(&token) {
                return Some(FinishReason::Eos);
            }
            if self.hits_stop(row) {
                return Some(FinishReason::Stop);
            }
            if grammar_end == Some(i + 1) {
                return Some(FinishReason::Grammar);
            }
            // The last token needs no position of its own: a sequence may reach context + 1.
            if row.tokens.len() >= row.max_tokens
                || row.prompt_len + row.tokens.len() > self.model.max_positions()
            {
                return Some(FinishReason::Length);
            }
        }
        None
    }

    /// Whether the output's tail now contains a stop string. Only the last tokens are
    /// decoded: each token is at least one byte, so a stop string of n bytes spans at
    /// most n tokens.
    fn hits_stop(&self, row: &Row) -> bool {
        let (Some(tok), Some(longest)) = (self.tokenizer, row.stop.iter().map(|s| s.len()).max()) else {
            return false;
        };
        let tail = &row.tokens[row.tokens.len().saturating_sub(longest + 1)..];
        match tok.decode(tail) {
            Ok(text) => row.stop.iter().any(|s| text.contains(s.as_str())),
            Err(_) => false,
        }
    }

    /// One round (see docs/design.md): choose each row's k, draft, verify every row in one
    /// forward (which also rolls caches back) with waiting prompts' pieces beside them (up
    /// to `prefill_chunk` tokens in all), then emit, commit and learn. Prompts that arrive
    /// while rows decode so delay their next token by a budget's share of a forward, never
    /// their whole prefill.
    fn round(&mut self, events: &mut Vec<Event>) {
        let t0 = Instant::now();
        let ks = self.choose_ks();
        let drafts = self.propose(&ks);
        let draft_time = t0.elapsed();
        let t1 = Instant::now();
        let one_time_before = self.model.one_time_forwards();
        let (masks, walk_errors) = self.walk_masks(&drafts);
        // A constrained row verifies only the drafts its grammar allows.
        let verified: Vec<usize> = drafts
            .iter()
            .zip(&masks)
            .map(|(d, m)| m.as_ref().map_or(d.tokens.len(), |m| m.len() - 1))
            .collect();
        let pending: Vec<u32> =
            self.active.iter().map(|r| *r.tokens.last().expect("a row has emitted")).collect();
        let batch = self.active.len();
        let verify_tokens = batch + verified.iter().sum::<usize>();
        let mut taken = self.take_pieces(piece_beside(self.opts.prefill_chunk, verify_tokens), events);
        let starts: Vec<usize> = self.active.iter().map(|r| r.cache.len()).collect();
        let hidden = self.drafter.as_ref().map_or(Hidden::None, |d| d.hidden());
        let mut rows: Vec<VerifyRow> = self
            .active
            .iter_mut()
            .zip(&pending)
            .zip(drafts.iter().zip(&verified).zip(&masks))
            .map(|((r, &p), ((d, &n), m))| VerifyRow {
                cache: &mut r.cache,
                pending: p,
                draft: &d.tokens[..n],
                draft_dists: &d.dists[..n.min(d.dists.len())],
                sampling: r.sampling,
                top_logprobs: r.top_logprobs,
                masks: m.as_deref(),
                hidden,
            })
            .collect();
        let beside = taken.iter_mut().map(|(p, piece)| p.input(*piece)).collect();
        let (results, beside_out) =
            verify_beside(self.model, &mut rows, self.opts.layout, self.opts.sampling_mode, beside);
        drop(rows);
        self.stats.verify_time += t1.elapsed();
        let plain_seconds = self.chooser.verify_seconds(batch);
        let outcomes = self.commit(results, walk_errors, &ks, &drafts, &pending, &starts, events);
        let rest_time = t1.elapsed();
        let carried_prompts = !taken.is_empty();
        if carried_prompts {
            self.absorb_pieces(taken, beside_out, events);
        }
        let emitted: usize = outcomes.iter().map(|o| o.accepted + 1).sum();
        // A verify that ran its shape for the first time or recorded it paid once what the
        // next will not, and one that carried a prompt's chunk paid for that too: neither
        // is a cost to learn.
        let steady = self.model.one_time_forwards() == one_time_before && !carried_prompts;
        self.chooser.observe(
            &outcomes,
            draft_time.as_secs_f64(),
            rest_time.as_secs_f64(),
            verify_tokens,
            steady,
        );
        self.stats.draft_time += draft_time;
        self.stats.rounds += 1;
        if let Some(plain) = plain_seconds.filter(|_| !carried_prompts) {
            self.stats.timed_rounds += t0.elapsed();
            let estimate = plain * emitted as f64 / batch as f64;
            if estimate.is_finite() && estimate >= 0.0 {
                self.stats.plain_estimate += Duration::from_secs_f64(estimate);
            }
        }
        tracing::debug!(
            round = self.stats.rounds,
            rows = batch,
            ?ks,
            verify_tokens,
            steady,
            accepted = ?outcomes.iter().map(|o| o.accepted).collect::<Vec<_>>(),
            draft_ms = draft_time.as_secs_f64() * 1e3,
            rest_ms = rest_time.as_secs_f64() * 1e3,
            "round"
        );
    }

    /// Each constrained row's grammar masks along its draft, and its grammar's failures.
    fn walk_masks(&mut self, drafts: &[Proposal]) -> (Vec<Option<Vec<TokenMask>>>, Vec<Option<String>>) {
        walk_masks(self.active.iter_mut().map(|r| r.guide.as_mut()).collect(), drafts)
    }

    /// Each active row's k this round: none past max_tokens or the context; fixed, or
    /// chosen by the adaptive policy.
    fn choose_ks(&mut self) -> Vec<usize> {
        let context = self.model.max_positions();
        let shared_base = self.active.iter().map(|r| r.cache.len()).max().unwrap_or(0);
        let caps: Vec<usize> = self
            .active
            .iter()
            .map(|r| {
                if !r.drafting || self.drafter.is_none() {
                    return 0;
                }
                let base = match self.opts.layout {
                    WindowLayout::RowTail => r.cache.len(),
                    WindowLayout::SharedSlots => shared_base,
                };
                self.opts.k.max().min(r.max_tokens - r.tokens.len() - 1).min(context.saturating_sub(base + 1))
            })
            .collect();
        if let DraftLen::Fixed(_) = self.opts.k {
            return caps;
        }
        let rejection = self.opts.sampling_mode == SamplingMode::Rejection;
        let candidates: Vec<Candidate> = self
            .active
            .iter()
            .zip(&caps)
            .filter(|(_, &cap)| cap > 0)
            .map(|(r, &cap)| Candidate {
                row: r.id,
                cap,
                self_paced: rejection && !r.sampling.is_greedy(),
                behind: r.behind,
                remaining: r.max_tokens - r.tokens.len(),
            })
            .collect();
        let mut chosen = self.chooser.choose(&candidates, caps.len() - candidates.len()).into_iter();
        caps.iter().map(|&cap| if cap > 0 { chosen.next().unwrap_or(0) } else { 0 }).collect()
    }

    /// Drafts for every row with k > 0 in one call; a failing drafter means no drafts
    /// this round (verify still runs).
    fn propose(&mut self, ks: &[usize]) -> Vec<Proposal> {
        let mut drafts: Vec<Proposal> = vec![Proposal::default(); self.active.len()];
        let (asks, targets): (Vec<DraftAsk>, Vec<&RowCache>) = self
            .active
            .iter()
            .zip(ks)
            .filter(|(_, &k)| k > 0)
            .map(|(r, &k)| (DraftAsk { row: r.id, k, sampling: r.sampling }, &r.cache))
            .unzip();
        let Some(d) = self.drafter.as_mut() else { return drafts };
        if asks.is_empty() {
            return drafts;
        }
        match d.propose_reading(&asks, &targets) {
            Ok(proposed) => {
                let mut it = proposed.into_iter();
                for (i, &k) in ks.iter().enumerate() {
                    if k > 0 {
                        drafts[i] = it.next().unwrap_or_default();
                        drafts[i].tokens.truncate(k);
                        drafts[i].dists.truncate(k);
                    }
                }
            }
            Err(e) => tracing::warn!("drafter: {e}; verifying this round without drafts"),
        }
        drafts
    }

    /// Emits each row's verified tokens, retires finished and failed rows, and commits the
    /// kept positions to the drafter. Returns what each verified row did.
    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        results: Vec<Result<Verified, Error>>,
        walk_errors: Vec<Option<String>>,
        ks: &[usize],
        drafts: &[Proposal],
        pending: &[u32],
        starts: &[usize],
        events: &mut Vec<Event>,
    ) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(results.len());
        let mut rows = std::mem::take(&mut self.active);
        let mut keep = Vec::with_capacity(rows.len());
        for (i, ((mut row, result), walk_error)) in rows.drain(..).zip(results).zip(walk_errors).enumerate() {
            let v = match (result, walk_error) {
                (_, Some(msg)) => {
                    events.push(Event::Failed { request: row.id, error: grammar_error(&row.name, msg) });
                    self.release(&row);
                    continue;
                }
                (Ok(v), None) => v,
                (Err(e), None) => {
                    events.push(Event::Failed { request: row.id, error: with_request(e, &row.name) });
                    self.release(&row);
                    continue;
                }
            };
            let bonus = *v.tokens.last().expect("verify emits the bonus token");
            let grammar_end = match row.guide.as_mut().map(|g| g.settle(v.accepted, bonus)) {
                None => None,
                Some(Ok(end)) => end,
                Some(Err(msg)) => {
                    events.push(Event::Failed { request: row.id, error: grammar_error(&row.name, msg) });
                    self.release(&row);
                    continue;
                }
            };
            // Only tokens the row emits: past a completed grammar nothing is.
            let emitted = grammar_end.unwrap_or(v.logprobs.len()).min(v.logprobs.len());
            let first = row.prompt_len + row.tokens.len();
            if let Err(e) = self.sane(&v.tokens[..emitted], &v.logprobs[..emitted], first, &row.name) {
                events.push(Event::Failed { request: row.id, error: e });
                self.release(&row);
                continue;
            }
            self.stats.record(drafts[i].tokens.len(), v.accepted);
            events.push(Event::Verified {
                request: row.id,
                drafted: drafts[i].tokens.len(),
                accepted: v.accepted,
            });
            let behind = if ks[i] > 0 { std::mem::take(&mut row.behind) } else { 0 };
            row.behind += v.accepted + 1;
            outcomes.push(Outcome {
                row: row.id,
                behind,
                asked: ks[i],
                drafted: drafts[i].tokens.len(),
                accepted: v.accepted,
            });
            if let Some(reason) = self.emit(&mut row, &v.tokens, &v.logprobs, v.top, grammar_end, events) {
                events.push(Event::Finished { request: row.id, reason });
                self.release(&row);
                continue;
            }
            let kept: Vec<u32> =
                std::iter::once(pending[i]).chain(drafts[i].tokens[..v.accepted].iter().copied()).collect();
            // Empty unless the drafter reads hidden states (the verify asked for them then).
            let hidden: &[f32] = &v.hidden;
            self.drafter_commit(&mut row, Commit { start: starts[i], tokens: &kept, hidden, next: bonus });
            keep.push(row);
        }
        self.active = keep;
        outcomes
    }
}

/// Names the request in an error that came from a batched call.
fn with_request(e: Error, name: &str) -> Error {
    match e {
        Error::Request { msg, .. } => Error::Request { request: name.to_string(), msg },
        other => Error::Request { request: name.to_string(), msg: other.to_string() },
    }
}
