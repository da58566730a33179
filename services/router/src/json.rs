//! The one JSON shape of a response: printed by `run --json` and `generate --json`
//! (`{"token_ids": [...], "text": "...", "finish_reason": "...", "stats": {...}}`, generated ids
//! only, not the prompt) and carried by the HTTP API's `wavefront` extension object; and of a
//! canvas event (`run --stream-canvas` lines, the HTTP API's `canvas` events).

use serde_json::{json, Map, Value};
use wavefront_proto::v1 as pb;

pub fn finish_reason_name(r: i32) -> &'static str {
    match pb::FinishReason::try_from(r).unwrap_or(pb::FinishReason::Unspecified) {
        pb::FinishReason::Length => "length",
        pb::FinishReason::StopToken => "stop_token",
        pb::FinishReason::StopString => "stop_string",
        pb::FinishReason::ContextLimit => "context_limit",
        pb::FinishReason::Unspecified => "unspecified",
    }
}

/// One canvas event: `{"canvas": {"step", "full", "positions", "token_ids", "states"}}` with
/// states named `masked`, `drafted`, `committed`, `locked`.
pub fn canvas_json(c: &pb::CanvasEvent) -> Value {
    let states: Vec<&str> = c
        .states
        .iter()
        .map(
            |&s| match pb::CellState::try_from(s).unwrap_or(pb::CellState::Unspecified) {
                pb::CellState::Masked => "masked",
                pb::CellState::Drafted => "drafted",
                pb::CellState::Committed => "committed",
                pb::CellState::Locked => "locked",
                pb::CellState::Unspecified => "unspecified",
            },
        )
        .collect();
    json!({"canvas": {
        "step": c.step,
        "full": c.full,
        "positions": c.positions,
        "token_ids": c.token_ids,
        "states": states,
    }})
}

/// A log-probability as JSON: a token outside the distribution's support (negative infinity,
/// which JSON cannot hold) as -9999.0, as vLLM writes it.
pub fn logprob_value(lp: f32) -> Value {
    if lp.is_finite() {
        json!(lp)
    } else if lp.is_nan() {
        // No value (an echoed prompt's first token).
        Value::Null
    } else {
        json!(-9999.0)
    }
}

/// The response's log-probabilities by token id, with each token's text.
fn logprobs_list(lps: &[pb::TokenLogprob]) -> Value {
    lps.iter()
        .map(|l| {
            json!({
                "token_id": l.token_id,
                "token": l.token,
                "logprob": logprob_value(l.logprob),
                "top_logprobs": l.top_logprobs.iter().map(|t| json!({
                    "token_id": t.token_id,
                    "token": t.token,
                    "logprob": logprob_value(t.logprob),
                })).collect::<Vec<_>>(),
            })
        })
        .collect()
}

pub fn response_json(r: &pb::GenerateResponse) -> Value {
    let s = r.stats.clone().unwrap_or_default();
    let counters: Map<String, Value> = s
        .counters
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    let series: Map<String, Value> = s
        .series
        .iter()
        .map(|(k, v)| (k.clone(), json!(v.values)))
        .collect();
    let mut v = json!({
        "token_ids": r.token_ids,
        "text": r.text,
        "finish_reason": finish_reason_name(r.finish_reason),
        "stats": {
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "forward_passes": s.forward_passes,
            "recurrence_steps": s.recurrence_steps,
            "ticks": s.ticks,
            "queue_time_ms": s.queue_time_ms,
            "compute_time_ms": s.compute_time_ms,
            "tokens_per_second": s.tokens_per_second,
            "seed": s.seed,
            "counters": counters,
            "series": series,
        },
    });
    if !r.logprobs.is_empty() {
        v["logprobs"] = logprobs_list(&r.logprobs);
    }
    if !r.prompt_logprobs.is_empty() {
        v["prompt_logprobs"] = logprobs_list(&r.prompt_logprobs);
        v["prompt_text"] = json!(r.prompt_text);
    }
    v
}
