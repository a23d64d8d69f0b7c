//! Prompts into caches. [`prefill`] runs a whole prompt in chunks; [`Prompt`] is one the
//! engine has admitted and runs a piece at a time: pieces of several prompts share a
//! forward up to the engine's token budget, beside the decoding rows' verify (a [`Piece`]
//! beside the verify rows), so a long prompt costs their rounds a budget's share of a
//! forward, never its whole prefill.
//! Chunking never changes a bit (the model's chunking invariance), so a row's tokens are the
//! same however its prompt was cut.

use mtp_base::logits::top_logprobs;
use mtp_base::{Error, LogitSummary};
use mtp_cache::RowCache;
use mtp_constraint::Guide;
use mtp_model::{Hidden, Logits, Model, RowInput, RowOutput};

use crate::request::{PromptToken, Request, RequestId};

/// What a prompt run through a cache leaves: the LM head's reading after its last token.
#[derive(Clone, Debug)]
pub struct Prefilled {
    /// The summary of the logits after the last token.
    pub summary: LogitSummary,
    /// Those logits, when asked for (empty otherwise).
    pub logits: Vec<f32>,
    /// The final-normed hidden state of every prompt position, when asked for.
    pub hidden: Vec<f32>,
}

/// Room in `cache` for `tokens` more positions, or the request's out-of-memory error.
fn reserve(model: &Model, cache: &mut RowCache, tokens: usize) -> Result<(), Error> {
    cache.try_reserve_window(cache.len(), tokens).map_err(|e| Error::Request {
        request: String::new(),
        msg: format!(
            "out of memory: cannot allocate {} bytes of KV for the prompt ({e})",
            tokens * model.kv_bytes_per_token()
        ),
    })
}

/// One forward of `piece` after what `cache` holds, committed. The last piece of a prompt
/// returns the LM head's reading (`hidden` gains the piece's hidden states when asked for).
fn run_piece(
    model: &Model,
    cache: &mut RowCache,
    piece: &[u32],
    last: bool,
    hidden: Option<(Hidden, &mut Vec<f32>)>,
    full_logits: bool,
) -> Result<Option<(LogitSummary, Vec<f32>)>, Error> {
    let want_hidden = hidden.as_ref().map_or(Hidden::None, |(kind, _)| *kind);
    let hidden = hidden.map(|(_, h)| h);
    let logits = if last { Logits::Last } else { Logits::None };
    let out = forward_alone(model, piece_input(cache, piece, logits, full_logits, want_hidden));
    absorb(cache, piece.len(), out, hidden).map(|mut read| read.pop())
}

/// One row's forward of its own.
fn forward_alone(model: &Model, row: RowInput) -> Result<RowOutput, Error> {
    model.forward(&mut [row]).map(|mut outs| outs.pop().expect("one row in, one row out"))
}

/// A prompt's piece as a forward's row: its hidden states only for a drafter that reads
/// them.
fn piece_input<'a>(
    cache: &'a mut RowCache,
    piece: &'a [u32],
    logits: Logits,
    full_logits: bool,
    hidden: Hidden,
) -> RowInput<'a> {
    RowInput { tokens: piece, cache, logits, full_logits, hidden }
}

/// Commits a piece's forward (nothing of a failed one) and returns its LM-head readings,
/// one per token whose logits it asked for (logits empty where it asked for summaries).
fn absorb(
    cache: &mut RowCache,
    piece_len: usize,
    out: Result<RowOutput, Error>,
    hidden: Option<&mut Vec<f32>>,
) -> Result<Vec<(LogitSummary, Vec<f32>)>, Error> {
    cache.commit_window(if out.is_ok() { piece_len } else { 0 });
    let o = out?;
    if let Some(h) = hidden {
        h.extend_from_slice(&o.hidden);
    }
    let mut logits = o.logits.into_iter();
    Ok(o.summaries.into_iter().map(|summary| (summary, logits.next().unwrap_or_default())).collect())
}

/// Most tokens a piece of a scored prompt takes: its whole logits come back (a 256-token
/// piece of a 152k vocabulary is 155 MB of them).
pub(crate) const SCORED_PIECE: usize = 256;

/// A scored prompt's readings so far ([`Request::prompt_logprobs`]).
pub(crate) struct Scoring {
    /// Alternatives per token.
    top: usize,
    /// Tokens `1..=scores.len()` of the prompt, scored.
    scores: Vec<PromptToken>,
}

impl Scoring {
    pub fn new(top: usize) -> Scoring {
        Scoring { top, scores: Vec::new() }
    }

    /// Scores `next` under the reading after the token before it.
    fn read(&mut self, summary: &LogitSummary, logits: &[f32], next: u32) {
        let logit = logits[next as usize];
        let above = logits.iter().filter(|&&l| l > logit).count();
        self.scores.push(PromptToken {
            token: next,
            logprob: summary.logprob(logit),
            rank: u32::try_from(above).unwrap_or(u32::MAX).saturating_add(1),
            top: top_logprobs(logits, summary, self.top),
        });
    }
}

/// Runs `prompt` (not empty) through `cache` in chunks of `chunk` tokens.
pub fn prefill(
    model: &Model,
    cache: &mut RowCache,
    prompt: &[u32],
    chunk: usize,
    want_hidden: impl Into<Hidden>,
    full_logits: bool,
) -> Result<Prefilled, Error> {
    let want_hidden = want_hidden.into();
    if prompt.is_empty() {
        return Err(Error::InvalidOption("cannot prefill an empty prompt".into()));
    }
    reserve(model, cache, prompt.len())?;
    if chunk == 0 {
        return Err(Error::InvalidOption("prefill chunk must be at least 1 token".into()));
    }
    let (mut last, mut hidden) = (None, Vec::new());
    let n_chunks = prompt.len().div_ceil(chunk);
    for (i, piece) in prompt.chunks(chunk).enumerate() {
        let h = want_hidden.wanted().then_some((want_hidden, &mut hidden));
        if let Some(l) = run_piece(model, cache, piece, i + 1 == n_chunks, h, full_logits)? {
            last = Some(l);
        }
    }
    let (summary, logits) =
        last.ok_or_else(|| Error::Backend("the prompt's last forward returned no logits".into()))?;
    Ok(Prefilled { summary, logits, hidden })
}

/// An admitted request whose prompt is going into its cache (a cached prefix already is).
pub(crate) struct Prompt {
    pub id: RequestId,
    pub request: Request,
    pub guide: Option<Guide>,
    pub cache: RowCache,
    /// Prompt tokens loaded from the prefix cache.
    pub reused: usize,
    /// Final-normed hidden states of the prompt so far (when the drafter reads them).
    pub hidden: Vec<f32>,
    pub want_hidden: Hidden,
    /// The last forward returns the whole logits row (sampling, logprobs, a grammar).
    pub full_logits: bool,
    /// A preempted row whose prompt and emitted tokens (`request.prompt`) are being
    /// recomputed: it decodes on once they are in the cache.
    pub resumes: Option<Box<crate::engine::Row>>,
    /// A scored prompt's readings (every piece reads the logits after each of its tokens).
    pub scoring: Option<Scoring>,
}

/// Prompt tokens a round carries beside `verifying` tokens of decoding rows: what fills
/// the forward up to `chunk` tokens, never less than half a chunk. A forward just past a
/// whole number of the GPU's token tiles pays for one more tile (measured: a 512-token
/// piece beside 8 decoding rows cost 18% more than the piece alone), and the CPU's cost
/// is linear in tokens, so filling to `chunk` costs neither anything.
pub(crate) fn piece_beside(chunk: usize, verifying: usize) -> usize {
    chunk.saturating_sub(verifying).max(chunk.div_ceil(2))
}

/// The prompt tokens `[start, end)`: what one forward of a [`Prompt`] runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    start: usize,
    end: usize,
}

impl Piece {
    /// Tokens in the piece.
    pub fn len(self) -> usize {
        self.end - self.start
    }
}

impl Prompt {
    /// The next piece of at most `chunk` tokens (at least 1). Before the first, reserves
    /// KV for the rest of the prompt.
    pub fn next_piece(&mut self, model: &Model, chunk: usize) -> Result<Piece, Error> {
        let start = self.cache.len();
        if start == self.reused {
            reserve(model, &mut self.cache, self.request.prompt.len() - start)?;
        }
        let most = if self.scoring.is_some() { chunk.min(SCORED_PIECE) } else { chunk };
        let end = start.saturating_add(most.max(1)).min(self.request.prompt.len());
        Ok(Piece { start, end })
    }

    fn is_last(&self, piece: Piece) -> bool {
        piece.end == self.request.prompt.len()
    }

    /// `piece` as a row of a forward (its own, or a verify's: `verify_beside`).
    pub fn input(&mut self, piece: Piece) -> RowInput<'_> {
        let logits = match (self.scoring.is_some(), self.is_last(piece)) {
            (true, _) => Logits::All,
            (false, true) => Logits::Last,
            (false, false) => Logits::None,
        };
        let full = self.full_logits || self.scoring.is_some();
        let piece = &self.request.prompt[piece.start..piece.end];
        piece_input(&mut self.cache, piece, logits, full, self.want_hidden)
    }

    /// Commits `piece`'s forward; after the last piece, the LM head's reading.
    pub fn absorb(
        &mut self,
        piece: Piece,
        out: Result<RowOutput, Error>,
    ) -> Result<Option<Prefilled>, Error> {
        let hidden = self.want_hidden.wanted().then_some(&mut self.hidden);
        let mut read = absorb(&mut self.cache, piece.end - piece.start, out, hidden)?;
        let last = self.is_last(piece).then(|| read.pop()).flatten();
        if let Some(s) = self.scoring.as_mut() {
            // Reading r follows prompt token start + r; the prompt's last is `last`'s.
            let shift = usize::from(crate::negative_control::score_unshifted());
            for (r, (summary, logits)) in read.iter().enumerate() {
                let next = self.request.prompt[piece.start + r + 1 - shift];
                s.read(summary, logits, next);
            }
        }
        match (self.is_last(piece), last) {
            (false, _) => Ok(None),
            (true, Some((summary, logits))) => {
                Ok(Some(Prefilled { summary, logits, hidden: std::mem::take(&mut self.hidden) }))
            }
            (true, None) => Err(Error::Backend("the prompt's last forward returned no logits".into())),
        }
    }

    /// The scores of a prompt wholly in its cache (`None` when it asked for none).
    pub fn take_scores(&mut self) -> Option<Vec<PromptToken>> {
        self.scoring.take().map(|s| s.scores)
    }
}

#[cfg(test)]
mod tests {
    use super::piece_beside;

    #[test]
    fn a_piece_fills_the_forward_to_a_chunk_and_is_never_under_half_of_one() {
        assert_eq!(piece_beside(2048, 40), 2008);
        assert_eq!(piece_beside(512, 8), 504);
        assert_eq!(piece_beside(64, 72), 32);
        assert_eq!(piece_beside(5, 4), 3);
        assert_eq!(piece_beside(1, 9), 1);
    }
}
