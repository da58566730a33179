//! Structured outputs' cost, side by side in one run on the trained models in models/: for each
//! model and scheme, the same requests unconstrained and under a JSON schema, a regular
//! expression and a choice, served one after another and packed together (alternating
//! rounds); then the grammar engine's own time per token (mask and advance, replayed over the
//! constrained outputs). Prints one markdown table.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use wavefront_bench::run::{median, one_after_another, together, Outcome};
use wavefront_models::ModelFiles;
use wavefront_schemes::constraint::Constraint;
use wavefront_schemes::{
    load_model, ArParams, GenerateSpec, LoadOptions, LowConfidenceParams, SchemeParams, ServedModel,
};

#[derive(Parser, Debug)]
#[command(about = "Structured outputs' cost, side by side with unconstrained requests")]
struct Args {
    /// The directory holding the trained checkpoints (huginn-tiny, llada-tiny).
    #[arg(long, default_value = "models")]
    models: PathBuf,
    /// Requests per measurement.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Rounds (each measures every constraint once, alternating).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
}

fn constraints() -> Vec<(&'static str, Option<Constraint>)> {
    vec![
        ("none", None),
        (
            "json schema",
            Some(Constraint::JsonSchema {
                schema: serde_json::json!({
                    "type": "object",
                    "properties": {
                        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
                        "ok": {"type": "boolean"}
                    },
                    "required": ["answer", "ok"],
                    "additionalProperties": false
                }),
                strict: true,
            }),
        ),
        (
            "regex",
            Some(Constraint::Regex("[a-z]{2,6}=[0-9]{1,3}".into())),
        ),
        (
            "choice",
            Some(Constraint::Choice(vec!["yes".into(), "no".into()])),
        ),
    ]
}

struct Row {
    model: &'static str,
    scheme: &'static str,
    constraint: &'static str,
    alone_ms: Vec<f64>,
    packed_tok_s: Vec<f64>,
    tokens: f64,
    forwards: f64,
}

fn specs(
    served: &dyn ServedModel,
    scheme: &SchemeParams,
    c: &Option<Constraint>,
    args: &Args,
) -> Result<Vec<GenerateSpec>> {
    (0..args.requests)
        .map(|i| {
            let prompt =
                served.encode_prompt(&format!("copy {} =", ["a b", "c d e", "f"][i % 3]))?;
            let mut s = GenerateSpec::greedy(prompt, args.max_new_tokens, i as u64, scheme.clone());
            s.guide = match c {
                None => None,
                Some(c) => Some(served.guide(c).map_err(anyhow::Error::msg)?),
            };
            Ok(s)
        })
        .collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    let cases: Vec<(&'static str, &'static str, SchemeParams)> = vec![
        ("huginn-tiny", "ar", SchemeParams::Ar(ArParams::default())),
        (
            "llada-tiny",
            "low-confidence",
            SchemeParams::LowConfidence(LowConfidenceParams {
                block_length: Some(args.max_new_tokens),
                steps: Some(args.max_new_tokens),
                ..LowConfidenceParams::default()
            }),
        ),
    ];
    let mut rows = Vec::new();
    let mut engine_us = Vec::new();
    for (model, scheme_name, scheme) in &cases {
        let files = ModelFiles::from_dir(args.models.join(model))
            .with_context(|| format!("{}", args.models.join(model).display()))?;
        let served = load_model(
            files,
            LoadOptions {
                max_active: args.requests,
                ..LoadOptions::default()
            },
        )?;
        let mut mine: Vec<Row> = constraints()
            .iter()
            .map(|(name, _)| Row {
                model,
                scheme: scheme_name,
                constraint: name,
                alone_ms: Vec::new(),
                packed_tok_s: Vec::new(),
                tokens: 0.0,
                forwards: 0.0,
            })
            .collect();
        // Warm-up.
        one_after_another(
            served.as_ref(),
            specs(served.as_ref(), scheme, &None, &args)?,
        )?;
        for _ in 0..args.rounds {
            for (row, (_, c)) in mine.iter_mut().zip(constraints()) {
                let (outs, wall) =
                    one_after_another(served.as_ref(), specs(served.as_ref(), scheme, &c, &args)?)?;
                row.alone_ms
                    .push(wall.as_secs_f64() * 1e3 / outs.len() as f64);
                let count = |o: &[Outcome]| o.iter().map(|o| o.tokens.len()).sum::<usize>();
                row.tokens = count(&outs) as f64 / outs.len() as f64;
                row.forwards = outs
                    .iter()
                    .map(|o| o.stats.forward_passes as f64)
                    .sum::<f64>()
                    / outs.len() as f64;
                let (outs, wall) =
                    together(served.as_ref(), specs(served.as_ref(), scheme, &c, &args)?)?;
                row.packed_tok_s
                    .push(count(&outs) as f64 / wall.as_secs_f64());
                // The engine's own time per token: the outputs replayed through a fresh guide.
                if let Some(c) = &c {
                    let vocab = served.info().vocab_size;
                    let mut logits = vec![0f32; vocab];
                    for o in &outs {
                        let mut g = served.guide(c).map_err(anyhow::Error::msg)?;
                        let t0 = Instant::now();
                        for &t in &o.tokens {
                            logits.fill(0.0);
                            g.mask(&mut logits).map_err(anyhow::Error::msg)?;
                            if g.advance(t).map_err(anyhow::Error::msg)? {
                                break;
                            }
                        }
                        let n = o.tokens.len().max(1) as f64;
                        engine_us.push((model, c.name(), t0.elapsed().as_secs_f64() * 1e6 / n));
                    }
                }
            }
        }
        served.shutdown();
        rows.extend(mine);
    }
    println!("| model | scheme | constraint | tokens/request | forwards/request | ms/request alone | ms/forward alone | tokens/s, {} packed | ms/forward to none's |", args.requests);
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let base = rows
            .iter()
            .find(|b| b.model == r.model && b.constraint == "none")
            .expect("an unconstrained row");
        let per_forward = |r: &Row| median(&r.alone_ms) / r.forwards.max(1.0);
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.0} | {:.2}x |",
            r.model,
            r.scheme,
            r.constraint,
            r.tokens,
            r.forwards,
            median(&r.alone_ms),
            per_forward(r),
            median(&r.packed_tok_s),
            per_forward(r) / per_forward(base),
        );
    }
    println!();
    println!("| model | constraint | grammar engine µs/token (mask + advance, median) |");
    println!("|---|---|---:|");
    for (model, _, _) in &cases {
        for name in ["json", "regex", "choice"] {
            let v: Vec<f64> = engine_us
                .iter()
                .filter(|(m, c, _)| **m == *model && *c == name)
                .map(|x| x.2)
                .collect();
            if !v.is_empty() {
                println!("| {model} | {name} | {:.1} |", median(&v));
            }
        }
    }
    Ok(())
}
