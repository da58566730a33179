//! The trained checkpoints in `models/` (written by `training/`, in the upstream layouts) load
//! and answer held-out task prompts greedily through `wavefront run`. Their accuracy over the
//! whole held-out set is measured by `training/evaluate.py` (docs/benchmarks.md); here a few
//! answers stand for it, so a layout or tokenizer regression cannot pass.

use std::path::PathBuf;
use std::process::Command;

use crate::harness::{bin, json_result};

fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name)
}

/// The text `wavefront run` generates for `prompt` on a trained model, cut at its first
/// special token.
fn answer(name: &str, prompt: &str, args: &[&str]) -> String {
    let out = Command::new(bin())
        .args(["run", "--model", model(name).to_str().unwrap(), "--json"])
        .args(["--log-filter", "warn", "--prompt", prompt])
        .args(args)
        .output()
        .expect("run wavefront run");
    let text = json_result(&out)["text"].as_str().unwrap().to_owned();
    text.split("<|").next().unwrap().to_owned()
}

#[test]
fn the_trained_llada_copies_held_out_strings_with_low_confidence_remasking() {
    let lc = [
        "--scheme",
        "low-confidence",
        "--max-new-tokens",
        "16",
        "--steps",
        "16",
        "--block-length",
        "16",
    ];
    // Held-out prompts (training/common.py `held_out`): never seen in training.
    for (prompt, want) in [
        ("copy i r q c =", " i r q c"),
        ("copy q u m y =", " q u m y"),
    ] {
        assert_eq!(answer("llada-tiny", prompt, &lc), want, "{prompt}");
    }
}

#[test]
fn the_trained_huginn_sorts_held_out_digits_with_static_recurrence() {
    // Static depth at the checkpoint's mean recurrence; a fixed seed fixes the initial states.
    let ar = [
        "--scheme",
        "ar",
        "--num-steps",
        "8",
        "--seed",
        "0",
        "--max-new-tokens",
        "16",
    ];
    for (prompt, want) in [
        ("sort 9 0 1 8 =", " 0 1 8 9"),
        ("sort 6 8 2 3 7 =", " 2 3 6 7 8"),
    ] {
        assert_eq!(answer("huginn-tiny", prompt, &ar), want, "{prompt}");
    }
}
