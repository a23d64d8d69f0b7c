//! `GET /metrics`: Prometheus text exposition of what the server and the engine did.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use crate::AppState;

pub fn render(app: &AppState) -> String {
    let g = app.gauges.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let s = &g.stats;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let one = |v: f64| vec![(String::new(), v)];
    metric(
        "mtp_http_requests_total",
        "counter",
        "Generation requests received.",
        &one(app.requests.load(Ordering::Relaxed) as f64),
    );
    let refused: Vec<(String, f64)> = app
        .refused
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(status, n)| (format!("{{status=\"{status}\"}}"), *n as f64))
        .collect();
    metric("mtp_http_refused_total", "counter", "Requests answered with an error, by status.", &refused);
    let mut finished: Vec<(String, f64)> =
        g.finished.iter().map(|(reason, n)| (format!("{{reason=\"{reason}\"}}"), *n as f64)).collect();
    finished.sort_by(|a, b| a.0.cmp(&b.0));
    metric(
        "mtp_requests_finished_total",
        "counter",
        "Engine requests (choices) ended, by reason.",
        &finished,
    );
    metric(
        "mtp_requests_cancelled_by_disconnect_total",
        "counter",
        "Requests cancelled because their client went away.",
        &one(g.cancelled_by_disconnect as f64),
    );
    metric("mtp_prompt_tokens_total", "counter", "Prompt tokens admitted.", &one(s.prompt_tokens as f64));
    metric(
        "mtp_prompt_tokens_cached_total",
        "counter",
        "Prompt tokens whose K/V came from the prefix cache.",
        &one(s.prompt_tokens_cached as f64),
    );
    metric("mtp_generation_tokens_total", "counter", "Tokens generated.", &one(g.generated_tokens as f64));
    metric("mtp_draft_tokens_total", "counter", "Draft tokens verified.", &one(s.drafted as f64));
    metric("mtp_accepted_tokens_total", "counter", "Draft tokens accepted.", &one(s.accepted as f64));
    metric(
        "mtp_acceptance_rate",
        "gauge",
        "Accepted / drafted tokens since start.",
        &one(s.acceptance_rate()),
    );
    metric(
        "mtp_mean_accepted_length",
        "gauge",
        "Tokens per row per verify forward, bonus token included.",
        &one(s.mean_accepted_length()),
    );
    metric("mtp_engine_rounds_total", "counter", "Engine rounds (verify forwards).", &one(s.rounds as f64));
    metric("mtp_queue_depth", "gauge", "Requests waiting for admission.", &one(g.waiting as f64));
    metric("mtp_running_rows", "gauge", "Requests decoding now.", &one(g.running as f64));
    metric(
        "mtp_pending_requests",
        "gauge",
        "Requests held by the HTTP side (running, queued, streaming).",
        &one(app.pending.load(Ordering::SeqCst) as f64),
    );
    metric(
        "mtp_kv_bytes",
        "gauge",
        "Physical K/V bytes held by running rows, a block shared between rows counted once.",
        &one(g.kv.bytes as f64),
    );
    metric(
        "mtp_prefix_cache_bytes",
        "gauge",
        "Bytes held by the prefix cache.",
        &one(g.prefix_cache_bytes as f64),
    );
    metric(
        "mtp_kv_blocks_used",
        "gauge",
        "K/V allocations held by admitted rows and the prefix cache, a shared one once (blocks on a paged host store, row buffers on a device).",
        &one(g.kv.blocks_used as f64),
    );
    let free: Vec<(String, f64)> = g.kv.blocks_free.map(|f| (String::new(), f as f64)).into_iter().collect();
    metric(
        "mtp_kv_blocks_free",
        "gauge",
        "K/V blocks the KV budget still has room for (no sample without --kv-budget-mib).",
        &free,
    );
    metric(
        "mtp_preemptions_total",
        "counter",
        "Rows preempted for lack of K/V room (their tokens recomputed on resuming).",
        &one(s.preemptions as f64),
    );
    let l = &g.latency;
    l.time_to_first_token.render(
        &mut out,
        "mtp_time_to_first_token_seconds",
        "From the engine thread taking the request to its first token.",
    );
    l.inter_token.render(
        &mut out,
        "mtp_inter_token_latency_seconds",
        "Gap between a request's tokens, a step's gap spread evenly over the tokens it brought.",
    );
    l.queue.render(
        &mut out,
        "mtp_request_queue_time_seconds",
        "From the engine thread taking the request to its admission.",
    );
    l.end_to_end.render(
        &mut out,
        "mtp_e2e_request_latency_seconds",
        "From the engine thread taking the request to its end (finished, failed or cancelled).",
    );
    out
}
