//! The Python package's native half, `mtp._mtp`: the server's engine thread (shared with
//! an in-process HTTP server when one is started), requests submitted to it in the prompts
//! JSONL's shape, and their events read back with the GIL released. Every wait is bounded
//! (`timeout` seconds), so the Python half (`mtp/__init__.py`, which holds the API's shape)
//! sees Ctrl-C between waits and cancels what it started. A request whose stream is dropped
//! or cancelled is cancelled in the engine at its next round, as a client that went away.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::{mpsc, oneshot};

use mtp::base::Tokenizer;
use mtp::engine::{Request, SamplingMode};
use mtp::server::access::Access;
use mtp::server::worker::{Job, MakeDrafter, Update};
use mtp::server::{Server, ServerOptions};

create_exception!(_mtp, Error, PyException, "What the engine refused, in the CLI's words.");

fn error(e: anyhow::Error) -> PyErr {
    Error::new_err(mtp::error_report(&e))
}

/// A loaded target, its drafter and the engine thread running them.
#[pyclass(module = "mtp._mtp")]
struct Engine {
    server: Server,
    tokenizer: Option<Arc<Tokenizer>>,
    runtime: Arc<tokio::runtime::Runtime>,
    #[pyo3(get)]
    model_name: String,
    #[pyo3(get)]
    target_dir: String,
    #[pyo3(get)]
    vocab_size: usize,
    #[pyo3(get)]
    max_positions: usize,
    #[pyo3(get)]
    eos_token_ids: Vec<u32>,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (*, target, draft, drafter, backend, max_batch, k, max_k, ngram_min, ngram_max,
        kv_dtype, kv_bits, activations, tensor_parallel, kv_budget_mib, prefill_chunk, sampling,
        prefix_cache_mib, max_pending, served_model_name, tool_parser, reasoning_parser, chat_template))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        target: Option<PathBuf>,
        draft: Option<PathBuf>,
        drafter: String,
        backend: String,
        max_batch: usize,
        k: String,
        max_k: usize,
        ngram_min: usize,
        ngram_max: usize,
        kv_dtype: String,
        kv_bits: Option<usize>,
        activations: String,
        tensor_parallel: usize,
        kv_budget_mib: Option<usize>,
        prefill_chunk: Option<usize>,
        sampling: String,
        prefix_cache_mib: usize,
        max_pending: usize,
        served_model_name: Option<String>,
        tool_parser: String,
        reasoning_parser: String,
        chat_template: Option<PathBuf>,
    ) -> PyResult<Engine> {
        // The CLI's parsers, so a value is refused as its flag would be.
        fn arg<T>(name: &str, v: impl ToString, parse: fn(&str) -> Result<T, String>) -> PyResult<T> {
            let v = v.to_string();
            parse(&v).map_err(|e| Error::new_err(format!("{name}={v}: {e}")))
        }
        let batch = mtp::load::BatchOptions {
            max_batch: arg("max_batch", max_batch, mtp::at_least_one)?,
            k: arg("k", &k, mtp::parse_k)?,
            max_k: arg("max_k", max_k, mtp::draft_count)?,
            kv_budget_mib: kv_budget_mib
                .map(|m| arg("kv_budget_mib", m, mtp::mib_at_least_one))
                .transpose()?,
            prefill_chunk: prefill_chunk.map(|c| arg("prefill_chunk", c, mtp::at_least_one)).transpose()?,
        };
        let prefix_cache_mib = arg("prefix_cache_mib", prefix_cache_mib, mtp::mib)?;
        let max_pending = arg("max_pending", max_pending, mtp::at_least_one)?;
        arg("ngram_min", ngram_min, mtp::at_least_one)?;
        arg("ngram_max", ngram_max, mtp::at_least_one)?;
        let sampling_mode = SamplingMode::parse(&sampling).map_err(Error::new_err)?;
        let opts = mtp::load::TargetOptions {
            target: target.clone(),
            backend: backend.clone(),
            kv_dtype,
            kv_bits,
            activations,
            tensor_parallel,
        };
        let drafter = mtp::load::DrafterOptions { drafter, draft, ngram_min, ngram_max };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Error::new_err(format!("cannot start the runtime: {e}")))?;
        py.detach(move || {
            mtp::init_threads();
            let mtp::load::Loaded { dir, model, tokenizer } = opts.load().map_err(error)?;
            let mut engine = mtp::engine::EngineOptions {
                sampling_mode,
                prefix_cache_bytes: prefix_cache_mib << 20,
                ..batch.engine_options(&backend)
            };
            if engine.kv_budget_bytes.is_none() {
                engine.kv_budget_bytes = mtp::default_kv_budget(&model);
            }
            let model_name = served_model_name.unwrap_or_else(|| match &target {
                Some(arg) if *arg != dir => arg.to_string_lossy().into_owned(),
                None => "mtp-trained".into(),
                _ => dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            });
            let (d, m) = (dir.clone(), model.clone());
            let make: MakeDrafter = Box::new(move || {
                mtp::init_threads();
                drafter.make(&d, &m)
            });
            let tokenizer = tokenizer.map(Arc::new);
            let server_opts = ServerOptions {
                model_name: model_name.clone(),
                max_pending,
                tool_parser,
                reasoning_parser,
                chat_template,
                ..ServerOptions::default()
            };
            let server = Server::start(&dir, model.clone(), tokenizer.clone(), make, engine, server_opts)
                .map_err(error)?;
            Ok(Engine {
                server,
                tokenizer,
                runtime: Arc::new(runtime),
                model_name,
                target_dir: dir.display().to_string(),
                vocab_size: model.config.vocab_size,
                max_positions: model.max_positions(),
                eos_token_ids: model.config.eos_token_ids.clone(),
            })
        })
    }

    /// Submits one request given as a prompts-JSONL object (`line`), named `default_id`
    /// when it names none; `max_tokens` and `ignore_eos` are its defaults. Returns its
    /// stream at once: a refusal at admission is raised by the stream's first `next`.
    fn submit(&self, line: &str, default_id: &str, max_tokens: usize, ignore_eos: bool) -> PyResult<Stream> {
        let defaults = Request { max_tokens, ignore_eos, ..Request::default() };
        let (request, _) =
            mtp::prompts::parse_request(line, default_id, self.tokenizer.as_deref(), &defaults)
                .map_err(error)?;
        let (updates, rx) = mpsc::unbounded_channel();
        let (accepted, accepted_rx) = oneshot::channel();
        self.server
            .jobs()
            .send(Job { request, updates, accepted })
            .map_err(|_| Error::new_err("the engine thread has stopped"))?;
        Ok(Stream {
            state: Mutex::new(StreamState { accepted: Some(accepted_rx), updates: Some(rx) }),
            runtime: self.runtime.clone(),
        })
    }

    /// Starts an OpenAI chat completion (the body of `POST /v1/chat/completions`, JSON) on
    /// this engine, in-process: no socket. Poll the call for its status and body.
    fn chat(&self, body: String) -> Call {
        let router = self.server.router(SocketAddr::from(([127, 0, 0, 1], 0)));
        let task = self.runtime.spawn(async move {
            use tower::ServiceExt;
            let request = axum::http::Request::post("/v1/chat/completions")
                .header("host", "127.0.0.1")
                .header("content-type", "application/json")
                .body(axum::body::Body::from(body))
                .expect("a fixed method, path and headers");
            let response = match router.oneshot(request).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            let status = response.status().as_u16();
            let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await;
            (status, bytes.map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default())
        });
        Call { task: Mutex::new(Some(task)), runtime: self.runtime.clone() }
    }

    /// Serves the OpenAI API over this engine on `host:port` (0: a free port) from a
    /// thread of its own; returns the address bound and the handle that stops it.
    #[pyo3(signature = (host, port, api_key=None))]
    fn serve(
        &self,
        py: Python<'_>,
        host: String,
        port: u16,
        api_key: Option<String>,
    ) -> PyResult<(String, Serving)> {
        use std::net::ToSocketAddrs;
        let addr = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| {
                Error::new_err(format!("host {host} port {port}: not an address to listen on ({e})"))
            })?
            .next()
            .ok_or_else(|| Error::new_err(format!("host {host}: resolves to no address")))?;
        if api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return Err(Error::new_err("api_key is empty"));
        }
        let access = Access { api_key: api_key.map(|k| k.trim().to_string()), ..Access::default() };
        let server = self.server.clone().with_access(access);
        let (stop, stopped) = oneshot::channel::<()>();
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let runtime = self.runtime.clone();
        let thread = std::thread::Builder::new()
            .name("mtp-http".into())
            .spawn(move || {
                let shutdown = async {
                    let _ = stopped.await;
                };
                let tx = bound_tx.clone();
                let done =
                    runtime.block_on(server.serve_until(addr, move |a| drop(tx.send(Ok(a))), shutdown));
                if let Err(e) = done {
                    let _ = bound_tx.send(Err(e));
                }
            })
            .map_err(|e| Error::new_err(format!("cannot start the server thread: {e}")))?;
        let bound = py
            .detach(move || bound_rx.recv())
            .map_err(|_| Error::new_err("the server thread ended before listening"))?
            .map_err(error)?;
        Ok((
            format!("http://{bound}"),
            Serving { stop: Mutex::new(Some(stop)), thread: Mutex::new(Some(thread)) },
        ))
    }

    /// Token ids of `text` (as prompts are encoded).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        self.tok()?.encode(text).map_err(|e| Error::new_err(e.to_string()))
    }

    /// The text of `ids`.
    fn decode(&self, ids: Vec<u32>) -> PyResult<String> {
        self.tok()?.decode(&ids).map_err(|e| Error::new_err(e.to_string()))
    }

    fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// The engine's speculation and cache counters since it started.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = self.server.gauges();
        let s = &g.stats;
        let d = PyDict::new(py);
        d.set_item("rounds", s.rounds)?;
        d.set_item("verifies", s.verifies)?;
        d.set_item("drafted", s.drafted)?;
        d.set_item("accepted", s.accepted)?;
        d.set_item("acceptance_rate", s.acceptance_rate())?;
        d.set_item("mean_accepted_length", s.mean_accepted_length())?;
        d.set_item("estimated_speedup", s.estimated_speedup())?;
        d.set_item("prompt_tokens", s.prompt_tokens)?;
        d.set_item("prompt_tokens_cached", s.prompt_tokens_cached)?;
        d.set_item("preemptions", s.preemptions)?;
        d.set_item("generated_tokens", g.generated_tokens)?;
        d.set_item("running", g.running)?;
        d.set_item("waiting", g.waiting)?;
        Ok(d)
    }
}

impl Engine {
    fn tok(&self) -> PyResult<&Tokenizer> {
        self.tokenizer.as_deref().ok_or_else(|| {
            Error::new_err(format!("{}: the target has no tokenizer.json; give token ids", self.target_dir))
        })
    }
}

/// A scored prompt token as Python sees it: id, logprob, rank, alternatives.
type ScoredToken = (u32, f32, u32, Vec<(u32, f32)>);

struct StreamState {
    accepted: Option<oneshot::Receiver<Result<(), String>>>,
    /// None once cancelled or ended.
    updates: Option<mpsc::UnboundedReceiver<Update>>,
}

/// One request's events, in order.
#[pyclass(module = "mtp._mtp")]
struct Stream {
    state: Mutex<StreamState>,
    runtime: Arc<tokio::runtime::Runtime>,
}

#[pymethods]
impl Stream {
    /// The next event, waiting at most `timeout` seconds (None: nothing yet):
    /// `("token", id, logprob, [(id, logprob), ...])`, `("prompt", [(id, logprob, rank,
    /// [(id, logprob), ...]), ...])`, `("verified", drafted, accepted)` (one verify of the
    /// row: its tokens follow), `("finished", reason)` (the last), or the engine's
    /// refusal raised as `mtp.Error`. After the last event (or a cancel): `("ended",)`.
    fn next<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Option<Bound<'py, PyAny>>> {
        let wait = Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        let runtime = self.runtime.clone();
        let got = py.detach(|| {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(rx) = s.accepted.as_mut() {
                match runtime.block_on(async { tokio::time::timeout(wait, rx).await }) {
                    Err(_) => return Ok(None),
                    Ok(Ok(Ok(()))) => s.accepted = None,
                    Ok(Ok(Err(msg))) => {
                        s.accepted = None;
                        s.updates = None;
                        return Err(msg);
                    }
                    Ok(Err(_)) => {
                        s.updates = None;
                        return Err("the engine thread has stopped".to_string());
                    }
                }
            }
            let Some(rx) = s.updates.as_mut() else { return Ok(Some(None)) };
            match runtime.block_on(async { tokio::time::timeout(wait, rx.recv()).await }) {
                Err(_) => Ok(None),
                Ok(None) => {
                    s.updates = None;
                    Err("the engine thread has stopped".to_string())
                }
                Ok(Some(u)) => {
                    if matches!(u, Update::Finished(_) | Update::Failed(_)) {
                        s.updates = None;
                    }
                    Ok(Some(Some(u)))
                }
            }
        });
        let event = match got.map_err(Error::new_err)? {
            None => return Ok(None),
            Some(None) => ("ended",).into_pyobject(py)?.into_any(),
            Some(Some(Update::Token { token, logprob, top })) => {
                ("token", token, logprob, top).into_pyobject(py)?.into_any()
            }
            Some(Some(Update::Prompt(scores))) => {
                let scores: Vec<ScoredToken> =
                    scores.into_iter().map(|p| (p.token, p.logprob, p.rank, p.top)).collect();
                ("prompt", scores).into_pyobject(py)?.into_any()
            }
            Some(Some(Update::Verified { drafted, accepted })) => {
                ("verified", drafted, accepted).into_pyobject(py)?.into_any()
            }
            Some(Some(Update::Finished(reason))) => {
                ("finished", reason.as_str()).into_pyobject(py)?.into_any()
            }
            Some(Some(Update::Failed(msg))) => return Err(Error::new_err(msg)),
        };
        Ok(Some(event))
    }

    /// Stops the request: the engine frees its rows at its next round.
    fn cancel(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.updates = None;
        s.accepted = None;
    }
}

/// An in-process chat completion under way.
#[pyclass(module = "mtp._mtp")]
struct Call {
    task: Mutex<Option<tokio::task::JoinHandle<(u16, String)>>>,
    runtime: Arc<tokio::runtime::Runtime>,
}

#[pymethods]
impl Call {
    /// `(status, body)` once answered, waiting at most `timeout` seconds (None: not yet).
    fn poll(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<(u16, String)>> {
        let wait = Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        let runtime = self.runtime.clone();
        py.detach(|| {
            let mut t = self.task.lock().unwrap_or_else(|p| p.into_inner());
            let Some(task) = t.as_mut() else {
                return Err(Error::new_err("this call was already answered or cancelled"));
            };
            match runtime.block_on(async { tokio::time::timeout(wait, task).await }) {
                Err(_) => Ok(None),
                Ok(done) => {
                    *t = None;
                    done.map(Some).map_err(|e| Error::new_err(format!("the chat call failed: {e}")))
                }
            }
        })
    }

    /// Abandons the call: its request is cancelled as a client that went away.
    fn cancel(&self) {
        if let Some(task) = self.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
            task.abort();
        }
    }
}

/// An HTTP server started by `Engine.serve`.
#[pyclass(module = "mtp._mtp")]
struct Serving {
    stop: Mutex<Option<oneshot::Sender<()>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

#[pymethods]
impl Serving {
    /// Stops listening (connections under way finish first) and waits for the thread.
    fn stop(&self, py: Python<'_>) {
        if let Some(tx) = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            py.detach(|| drop(t.join()));
        }
    }
}

#[pymodule]
fn _mtp(m: &Bound<'_, PyModule>) -> PyResult<()> {
    mtp::init_logging("warn");
    m.add_class::<Engine>()?;
    m.add_class::<Stream>()?;
    m.add_class::<Call>()?;
    m.add_class::<Serving>()?;
    m.add("Error", m.py().get_type::<Error>())?;
    Ok(())
}
