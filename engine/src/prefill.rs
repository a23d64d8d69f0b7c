//! Prompts into caches. [`prefill`] runs a whole prompt in chunks; [`Prompt`] is one the
//! engine has admitted and runs a chunk at a time, so that while other rows decode a long
//! prompt costs each of their rounds one chunk's forward, never its whole prefill.
//! Chunking never changes a bit (the model's chunking invariance), so a row's tokens are the
//! same however its prompt was cut.

use mtp_base::{Error, LogitSummary};
use mtp_cache::RowCache;
use mtp_constraint::Guide;
use mtp_model::{Logits, Model, RowInput};

use crate::request::{Request, RequestId};

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
    hidden: Option<&mut Vec<f32>>,
    full_logits: bool,
) -> Result<Option<(LogitSummary, Vec<f32>)>, Error> {
    let want = if last { Logits::Last } else { Logits::None };
    let mut rows = [RowInput { tokens: piece, cache: &mut *cache, logits: want, full_logits }];
    let out = model.forward(&mut rows);
    let committed = if out.is_ok() { piece.len() } else { 0 };
    cache.commit_window(committed);
    let o = out?.pop().expect("one row in, one row out");
    if let Some(h) = hidden {
        h.extend_from_slice(&o.hidden);
    }
    let logits = o.logits.into_iter().next().unwrap_or_default();
    Ok(o.summaries.first().map(|&summary| (summary, logits)))
}

/// Runs `prompt` (not empty) through `cache` in chunks of `chunk` tokens.
pub fn prefill(
    model: &Model,
    cache: &mut RowCache,
    prompt: &[u32],
    chunk: usize,
    want_hidden: bool,
    full_logits: bool,
) -> Result<Prefilled, Error> {
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
        let h = want_hidden.then_some(&mut hidden);
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
    /// KV bytes reserved for it in the engine's budget.
    pub reserved: usize,
    /// Prompt tokens loaded from the prefix cache.
    pub reused: usize,
    /// Final-normed hidden states of the prompt so far (when the drafter reads them).
    pub hidden: Vec<f32>,
    pub want_hidden: bool,
    /// The last forward returns the whole logits row (sampling, logprobs, a grammar).
    pub full_logits: bool,
}

impl Prompt {
    /// Runs the next `chunk` tokens (at least 1); after the last, the LM head's reading.
    pub fn advance(&mut self, model: &Model, chunk: usize) -> Result<Option<Prefilled>, Error> {
        let start = self.cache.len();
        if start == self.reused {
            reserve(model, &mut self.cache, self.request.prompt.len() - start)?;
        }
        let end = start.saturating_add(chunk.max(1)).min(self.request.prompt.len());
        let last = end == self.request.prompt.len();
        let hidden = self.want_hidden.then_some(&mut self.hidden);
        let piece = &self.request.prompt[start..end];
        let read = run_piece(model, &mut self.cache, piece, last, hidden, self.full_logits)?;
        match (last, read) {
            (false, _) => Ok(None),
            (true, Some((summary, logits))) => {
                Ok(Some(Prefilled { summary, logits, hidden: std::mem::take(&mut self.hidden) }))
            }
            (true, None) => Err(Error::Backend("the prompt's last forward returned no logits".into())),
        }
    }
}
