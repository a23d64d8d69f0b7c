//! `mtp serve`: an OpenAI-compatible HTTP server over the engine, with Anthropic's Messages
//! API beside it ([`anthropic`]).
//!
//! The engine runs on its own thread ([`worker`]); the HTTP side (axum on tokio) turns
//! requests into engine jobs and streams their tokens back. Every response's tokens and
//! logprobs are bitwise those of the same request run alone with `mtp generate`, whatever
//! else the server is doing: that is the engine's guarantee, and the server adds nothing
//! that depends on other requests. A client that disconnects cancels its request.

pub mod access;
mod anthropic;
pub mod api;
mod body;
pub mod chat;
mod histogram;
mod metrics;
pub mod net;
mod output;
pub mod reasoning;
mod request_log;
mod responses;
mod routes;
pub mod text;
mod timing;
mod tokenize;
pub mod tools;
pub mod worker;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use mtp_base::Tokenizer;
use mtp_engine::EngineOptions;
use mtp_model::Model;

use crate::access::{Access, Gate};
use crate::api::ApiError;
use crate::chat::ChatTemplate;
use crate::net::Limits;
use crate::reasoning::Reasoning;
use crate::tools::ToolSyntax;
use crate::worker::{Gauges, Job, MakeDrafter};

/// How the server runs, beyond the engine's own options.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The name `/v1/models` lists and requests' `model` must match (when given).
    pub model_name: String,
    /// Requests (choices) held at once, running and queued; more get 429.
    pub max_pending: usize,
    /// Connections, timeouts and body sizes.
    pub limits: Limits,
    /// API key, allowed origins and hosts.
    pub access: Access,
    /// The tool-call syntax: `auto` (from the chat template's markup), `none`, or one of
    /// [`tools::SYNTAXES`].
    pub tool_parser: String,
    /// The reasoning markup: `auto` (from the chat template), `none`, or one of
    /// [`reasoning::Reasoning::NAMES`].
    pub reasoning_parser: String,
    /// A chat template file to use instead of the checkpoint's (`--chat-template`).
    pub chat_template: Option<std::path::PathBuf>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            model_name: "mtp".into(),
            max_pending: 256,
            limits: Limits::default(),
            access: Access::default(),
            tool_parser: "auto".into(),
            reasoning_parser: "auto".into(),
            chat_template: None,
        }
    }
}

/// What every handler shares.
pub struct AppState {
    jobs: Sender<Job>,
    tokenizer: Option<Arc<Tokenizer>>,
    template: Option<ChatTemplate>,
    /// How this model writes tool calls (none: requests asking for calls are refused).
    tool_syntax: Option<Box<dyn ToolSyntax>>,
    /// How replies' reasoning is marked (none: all of a reply is content).
    reasoning: Option<Reasoning>,
    /// Special tokens decoded as text for the parsers (the syntaxes' markers).
    markers: Vec<u32>,
    model_name: String,
    /// The text of the target's first EOS id and of its BOS id (`/tokenizer_info`).
    eos_token: Option<String>,
    bos_token: Option<String>,
    context: usize,
    vocab: usize,
    max_pending: usize,
    limits: Limits,
    pending: AtomicUsize,
    next_id: AtomicU64,
    started: u64,
    seeds: AtomicU64,
    gauges: Arc<Mutex<Gauges>>,
    requests: AtomicU64,
    refused: Mutex<std::collections::BTreeMap<u16, u64>>,
}

impl AppState {
    /// Answers a refused request, counting it by status.
    fn refuse(&self, e: ApiError) -> Response {
        self.count_refusal(&e);
        e.into_response()
    }

    /// Counts a refused request by status (whatever shape its error body takes).
    fn count_refusal(&self, e: &ApiError) {
        *self.refused.lock().unwrap_or_else(|p| p.into_inner()).entry(e.status.as_u16()).or_default() += 1;
        tracing::debug!(status = e.status.as_u16(), "{}", e.message);
    }

    /// A seed for a sampled request that gave none: distinct per request.
    fn fresh_seed(&self) -> u64 {
        let n = self.seeds.fetch_add(1, Ordering::Relaxed);
        (self.started << 20) ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

/// A server ready to bind: the engine thread is running. Clones share the engine thread
/// (one may answer in-process while another listens).
#[derive(Clone)]
pub struct Server {
    state: Arc<AppState>,
    access: Access,
}

impl Server {
    /// Starts the engine thread over `model` (checkpoint directory `dir`, for the chat
    /// template) with the drafter `make_drafter` builds there.
    pub fn start(
        dir: &Path,
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        make_drafter: MakeDrafter,
        engine: EngineOptions,
        opts: ServerOptions,
    ) -> Result<Server> {
        let template = match &opts.chat_template {
            Some(file) => Some(ChatTemplate::from_file(file, dir)?),
            None => ChatTemplate::from_dir(dir)?,
        };
        if template.is_none() {
            tracing::warn!("{}: no chat template; /v1/chat/completions will refuse requests", dir.display());
        }
        // A BOS or EOS text the tokenizer lacks would reach the model as plain text.
        if let (Some(t), Some(tok)) = (&template, &tokenizer) {
            for (key, text) in t.special_texts() {
                if !text.is_empty() && tok.hf().token_to_id(text).is_none() {
                    anyhow::bail!(
                        "{}: `{key}` `{text}` is no token of {}: the chat template would write it as plain text",
                        dir.join("tokenizer_config.json").display(),
                        tok.path().display()
                    );
                }
            }
        }
        let source = template.as_ref().map(ChatTemplate::source);
        let tool_syntax = tools::choose(&opts.tool_parser, source)?;
        let reasoning = match opts.reasoning_parser.as_str() {
            "none" => None,
            "auto" => source.and_then(Reasoning::detect),
            name => Some(Reasoning::from_name(name).with_context(|| {
                format!("--reasoning-parser {name}: not one of auto, none, {}", Reasoning::NAMES.join(", "))
            })?),
        };
        let mut markers: Vec<&str> = tool_syntax.as_deref().map(|s| s.markers().to_vec()).unwrap_or_default();
        if let Some(r) = reasoning {
            markers.extend(r.markers());
        }
        let markers = match &tokenizer {
            Some(tok) => markers.iter().filter_map(|m| tools::special_id(tok, m)).collect(),
            None => Vec::new(),
        };
        let (context, vocab) = (model.max_positions(), model.config.vocab_size);
        let text_of = |id: Option<&u32>| tokenizer.as_ref().and_then(|t| t.hf().id_to_token(*id?));
        let eos_token = text_of(model.config.eos_token_ids.first());
        let bos_token = text_of(model.config.bos_token_id.as_ref());
        let gauges = Arc::new(Mutex::new(Gauges::default()));
        let jobs = worker::spawn(model, tokenizer.clone(), make_drafter, engine, gauges.clone())?;
        let started =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Ok(Server {
            state: Arc::new(AppState {
                jobs,
                tokenizer,
                template,
                tool_syntax,
                reasoning,
                markers,
                model_name: opts.model_name,
                eos_token,
                bos_token,
                context,
                vocab,
                max_pending: opts.max_pending,
                limits: opts.limits,
                pending: AtomicUsize::new(0),
                next_id: AtomicU64::new(0),
                started,
                seeds: AtomicU64::new(0),
                gauges,
                requests: AtomicU64::new(0),
                refused: Mutex::new(Default::default()),
            }),
            access: opts.access,
        })
    }

    /// The endpoints, behind the access checks for a server bound to `bound`.
    pub fn router(&self, bound: SocketAddr) -> Router {
        let gate = Arc::new(Gate::new(self.access.clone(), bound));
        let mut router = Router::new()
            .route("/health", get(routes::health))
            .route("/metrics", get(routes::metrics))
            .route("/v1/models", get(routes::models))
            .route("/v1/models/{id}", get(tokenize::model))
            .route("/tokenize", post(tokenize::tokenize))
            .route("/detokenize", post(tokenize::detokenize))
            .route("/tokenizer_info", get(tokenize::info))
            .route("/v1/completions", post(routes::completions))
            .route("/v1/chat/completions", post(routes::chat))
            .route("/v1/messages", post(anthropic::messages))
            .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
            .route("/v1/responses", post(responses::create))
            // After the routes: it applies to those registered before it.
            .method_not_allowed_fallback(routes::method_not_allowed)
            .fallback(routes::not_found)
            .with_state(self.state.clone());
        if let Some(cors) = gate.cors() {
            router = router.layer(cors);
        }
        // Last, so outermost: refusals come before CORS and the endpoints.
        router.layer(axum::middleware::from_fn_with_state(gate, access::check))
    }

    /// Where requests for the engine thread go, beside the HTTP side's (the Python binding
    /// submits there).
    pub fn jobs(&self) -> Sender<Job> {
        self.state.jobs.clone()
    }

    /// The same server behind other access rules (its engine thread shared).
    pub fn with_access(mut self, access: Access) -> Server {
        self.access = access;
        self
    }

    /// The engine's gauges as the engine thread last published them.
    pub fn gauges(&self) -> Gauges {
        self.state.gauges.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Serves on `addr` until ctrl-c; `bound` is told the address actually bound (port 0
    /// picks a free one).
    pub async fn serve(self, addr: SocketAddr, bound: impl FnOnce(SocketAddr)) -> Result<()> {
        self.serve_until(addr, bound, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
    }

    /// [`Server::serve`] until `shutdown` completes instead of ctrl-c (an embedding process
    /// keeps its own signal handling).
    pub async fn serve_until(
        self,
        addr: SocketAddr,
        bound: impl FnOnce(SocketAddr),
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<()> {
        let listener =
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        if !local.ip().is_loopback() && self.access.api_key.is_none() {
            tracing::warn!("listening on {local}, beyond this machine, with no API key: anyone who reaches it may use it (--api-key or MTP_API_KEY)");
        }
        bound(local);
        let router = self.router(local);
        net::serve(listener, router, self.state.limits.clone(), shutdown).await;
        Ok(())
    }
}

impl Server {
    /// Serves on `addr` from a background thread with its own runtime (for embedding and
    /// tests); returns the bound address once it listens. The server lives as long as the
    /// process.
    pub fn spawn(self, addr: SocketAddr) -> Result<SocketAddr> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new().name("mtp-http".into()).spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(anyhow::Error::from(e)));
                    return;
                }
            };
            let done = rt.block_on(self.serve(addr, |a| {
                let _ = tx.send(Ok(a));
            }));
            if let Err(e) = done {
                tracing::error!("server: {e:#}");
            }
        })?;
        rx.recv().map_err(|_| anyhow::anyhow!("the server thread ended before listening"))?
    }

    /// [`Server::serve`] on a tokio runtime of its own (the binary's entry point).
    pub fn run_blocking(self, addr: SocketAddr) -> Result<()> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        rt.block_on(self.serve(addr, |a| {
            tracing::info!("serving the OpenAI API on http://{a}/v1 (ctrl-c stops)");
            eprintln!("listening on http://{a}");
        }))
    }
}
