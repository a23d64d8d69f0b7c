//! The engine's own thread: takes jobs from the HTTP side, steps the engine while anything
//! runs, streams each request's events back, and cancels requests whose client went away
//! (their K/V is freed at the next round). The gauges are published after each step and
//! before its updates are sent: a client that saw an update finds it counted in `/metrics`.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use mtp_base::Tokenizer;
use mtp_drafter::Drafter;
use mtp_engine::{
    Engine, EngineOptions, Event, FinishReason, KvUsage, PromptToken, Request, RequestId, SpecStats,
};
use mtp_model::Model;
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::timing::{Clock, Latencies};

/// What a request's stream receives, in order.
#[derive(Debug)]
pub enum Update {
    /// The prompt's scores (asked with `echo` and `logprobs`, or `prompt_logprobs`), before
    /// any token.
    Prompt(Vec<PromptToken>),
    Token {
        token: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
    },
    /// A verify of the request's row: draft tokens checked and kept ([`Event::Verified`]).
    Verified {
        drafted: usize,
        accepted: usize,
    },
    Finished(FinishReason),
    Failed(String),
}

/// One request for the engine, with where its updates go and where its admission (or
/// refusal) is reported.
pub struct Job {
    pub request: Request,
    pub updates: tmpsc::UnboundedSender<Update>,
    pub accepted: oneshot::Sender<Result<(), String>>,
}

/// What the engine thread publishes after every step (read by `/metrics`).
#[derive(Default, Clone)]
pub struct Gauges {
    pub waiting: usize,
    pub running: usize,
    pub kv: KvUsage,
    pub prefix_cache_bytes: usize,
    pub stats: SpecStats,
    pub finished: HashMap<&'static str, u64>,
    pub generated_tokens: u64,
    pub cancelled_by_disconnect: u64,
    pub latency: Latencies,
}

/// Builds the drafter on the engine thread (drafters need not be `Send`).
pub type MakeDrafter = Box<dyn FnOnce() -> Result<Option<Box<dyn Drafter>>> + Send>;

/// Starts the engine thread; returns once its drafter is built (or failed to build).
pub fn spawn(
    model: Arc<Model>,
    tokenizer: Option<Arc<Tokenizer>>,
    make_drafter: MakeDrafter,
    opts: EngineOptions,
    gauges: Arc<Mutex<Gauges>>,
) -> Result<Sender<Job>> {
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
    std::thread::Builder::new().name("mtp-engine".into()).spawn(move || {
        let drafter = match make_drafter() {
            Ok(d) => d,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        let engine = match Engine::new(&model, drafter, opts) {
            Ok(e) => e,
            Err(e) => {
                let _ = ready_tx.send(Err(e.into()));
                return;
            }
        };
        let engine = match tokenizer.as_deref() {
            Some(t) => engine.with_tokenizer(t),
            None => engine,
        };
        let _ = ready_tx.send(Ok(()));
        run(engine, jobs_rx, &gauges);
    })?;
    ready_rx.recv().map_err(|_| anyhow!("the engine thread ended while starting"))??;
    Ok(jobs_tx)
}

/// A live request: where its updates go and its timestamps.
struct Live {
    updates: tmpsc::UnboundedSender<Update>,
    clock: Clock,
}

fn run(mut engine: Engine, jobs: Receiver<Job>, gauges: &Mutex<Gauges>) {
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    let mut tally = Gauges::default();
    publish(&engine, &mut tally, gauges);
    loop {
        // Idle: wait for work (waking now and then to notice a shut-down server).
        if engine.is_idle() {
            match jobs.recv_timeout(Duration::from_millis(500)) {
                Ok(job) => take(&mut engine, &mut live, job),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        while let Ok(job) = jobs.try_recv() {
            take(&mut engine, &mut live, job);
        }
        let gone: Vec<RequestId> =
            live.iter().filter(|(_, l)| l.updates.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            if engine.cancel(id) {
                tally.cancelled_by_disconnect = tally.cancelled_by_disconnect.saturating_add(1);
            }
        }
        let events = engine.step();
        let now = Instant::now();
        let mut step_tokens: HashMap<RequestId, usize> = HashMap::new();
        for e in &events {
            if let Event::Token { request, .. } = e {
                *step_tokens.entry(*request).or_default() += 1;
            }
        }
        let outgoing: Vec<_> = events
            .into_iter()
            .filter_map(|e| route(e, now, &mut step_tokens, &mut live, &mut tally))
            .collect();
        publish(&engine, &mut tally, gauges);
        for (tx, update) in outgoing {
            // A closed receiver is cancelled before the next step.
            let _ = tx.send(update);
        }
    }
}

/// Reads the engine's gauges into `tally` and hands `/metrics` a copy.
fn publish(engine: &Engine, tally: &mut Gauges, gauges: &Mutex<Gauges>) {
    tally.waiting = engine.waiting();
    tally.running = engine.running();
    tally.kv = engine.kv_usage();
    tally.prefix_cache_bytes = engine.prefix_cache_bytes();
    tally.stats = engine.stats().clone();
    *gauges.lock().unwrap_or_else(|p| p.into_inner()) = tally.clone();
}

fn take(engine: &mut Engine, live: &mut HashMap<RequestId, Live>, job: Job) {
    let clock = Clock::start(Instant::now());
    match engine.submit(job.request) {
        Ok(id) => {
            live.insert(id, Live { updates: job.updates, clock });
            let _ = job.accepted.send(Ok(()));
        }
        Err(e) => {
            let _ = job.accepted.send(Err(e.to_string()));
        }
    }
}

/// Counts and times `event` (one of the step that ended at `now`, which brought
/// `step_tokens` tokens per request); returns the update to send and where.
fn route(
    event: Event,
    now: Instant,
    step_tokens: &mut HashMap<RequestId, usize>,
    live: &mut HashMap<RequestId, Live>,
    tally: &mut Gauges,
) -> Option<(tmpsc::UnboundedSender<Update>, Update)> {
    let lat = &mut tally.latency;
    let (id, update, last) = match event {
        Event::Admitted { request } => {
            if let Some(l) = live.get_mut(&request) {
                l.clock.admitted(now, lat);
            }
            return None;
        }
        Event::PromptScored { request, scores } => (request, Update::Prompt(scores), false),
        Event::Verified { request, drafted, accepted } => {
            (request, Update::Verified { drafted, accepted }, false)
        }
        Event::Token { request, token, logprob, top } => {
            tally.generated_tokens = tally.generated_tokens.saturating_add(1);
            // The step's tokens of this request are timed together, at its first.
            if let (Some(l), Some(n)) = (live.get_mut(&request), step_tokens.remove(&request)) {
                l.clock.tokens(now, n, lat);
            }
            (request, Update::Token { token, logprob, top }, false)
        }
        Event::Finished { request, reason } => {
            let n = tally.finished.entry(reason.as_str()).or_default();
            *n = n.saturating_add(1);
            (request, Update::Finished(reason), true)
        }
        Event::Failed { request, error } => {
            let n = tally.finished.entry("error").or_default();
            *n = n.saturating_add(1);
            (request, Update::Failed(error.to_string()), true)
        }
    };
    if last {
        let l = live.remove(&id)?;
        l.clock.ended(now, &mut tally.latency);
        Some((l.updates, update))
    } else {
        live.get(&id).map(|l| (l.updates.clone(), update))
    }
}
