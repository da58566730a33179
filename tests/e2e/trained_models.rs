//! The trained checkpoints in `models/` (written by `training/`, in the upstream layouts) load
//! and answer held-out task prompts greedily through `wavefront run`. Their accuracy over the
//! whole held-out set is measured by `training/evaluate.py` (docs/benchmarks.md); here a few
//! answers stand for it, so a layout or tokenizer regression cannot pass.

use std::path::PathBuf;
use std::process::Command;

use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{bin, channel, json_result, served_models, spawn, wait_serving};

fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name)
}

/// The JSON result of `wavefront run` on a trained model.
fn run_json(name: &str, prompt: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new(bin())
        .args(["run", "--model", model(name).to_str().unwrap(), "--json"])
        .args(["--log-filter", "warn", "--prompt", prompt])
        .args(args)
        .output()
        .expect("run wavefront run");
    json_result(&out)
}

/// The text `wavefront run` generates for `prompt` on a trained model, cut at its first
/// special token.
fn answer(name: &str, prompt: &str, args: &[&str]) -> String {
    cut(run_json(name, prompt, args)["text"].as_str().unwrap())
}

/// `text` up to its first special token.
fn cut(text: &str) -> String {
    text.split("<|").next().unwrap().to_owned()
}

/// Static depth 8 (the checkpoint's mean recurrence), seed 0: the Huginn tests' settings.
const HUGINN_AR: [&str; 8] = [
    "--scheme",
    "ar",
    "--num-steps",
    "8",
    "--seed",
    "0",
    "--max-new-tokens",
    "16",
];

/// Plan-and-infill at the paper's thresholds (slot and token 0.9), slots of 4: the ReFusion
/// tests' settings.
const REFUSION_PI: [&str; 4] = ["--scheme", "plan-infill", "--max-new-tokens", "16"];

/// Low-confidence remasking, one block of 16 in 16 steps: the LLaDA tests' settings.
const LLADA_LC: [&str; 8] = [
    "--scheme",
    "low-confidence",
    "--max-new-tokens",
    "16",
    "--steps",
    "16",
    "--block-length",
    "16",
];

#[test]
fn the_trained_llada_copies_and_sorts_held_out_strings_with_low_confidence_remasking() {
    // Held-out prompts (training/common.py `held_out`): never seen in training.
    for (prompt, want) in [
        ("copy i r q c =", " i r q c"),
        ("copy q u m y =", " q u m y"),
        ("sort 9 0 1 8 =", " 0 1 8 9"),
        ("sort 6 8 2 3 7 =", " 2 3 6 7 8"),
    ] {
        assert_eq!(answer("llada-tiny", prompt, &LLADA_LC), want, "{prompt}");
    }
}

#[test]
fn the_trained_llada_answers_held_out_tasks_as_chat_turns() {
    // LLaDA was fine-tuned on a share of its task lines as chat turns under its chat template
    // (training/README.md, session 38): `--chat` renders the prompt as a user message, and the
    // answer comes without the plain prompt's leading space, ended by `<|eot_id|>`.
    let chat = [&LLADA_LC[..], &["--chat"]].concat();
    for (prompt, want) in [
        ("sort 9 0 1 8 =", "0 1 8 9"),
        ("sort 6 8 2 3 7 =", "2 3 6 7 8"),
    ] {
        let got = run_json("llada-tiny", prompt, &chat);
        assert_eq!(got["text"], want, "{prompt}: {got}");
        assert_eq!(got["finish_reason"], "stop_token", "{got}");
    }
}

/// Fast-dLLM's setting on the trained LLaDA: a 64-token canvas in blocks of 16, exact
/// low-confidence against the prefix cache with the threshold rule. The checkpoint was
/// fine-tuned with answers padded to 16, 32 and 64 tokens (session 38; before, it sorted 74% of
/// held-out prompts in a 32-token canvas), and both settings answer these.
#[test]
fn the_trained_llada_answers_in_a_64_token_canvas_exactly_and_with_fast_dllm() {
    let exact = [
        "--scheme",
        "low-confidence",
        "--max-new-tokens",
        "64",
        "--block-length",
        "16",
        "--steps",
        "64",
    ];
    let fast = [
        &exact[..6],
        &["--steps", "4", "--kv-cache", "prefix", "--threshold", "0.9"],
    ]
    .concat();
    for (prompt, want) in [
        ("sort 9 0 1 8 =", " 0 1 8 9"),
        ("copy i r q c =", " i r q c"),
    ] {
        let a = run_json("llada-tiny", prompt, &exact);
        let b = run_json("llada-tiny", prompt, &fast);
        assert_eq!(
            (
                cut(a["text"].as_str().unwrap()),
                cut(b["text"].as_str().unwrap())
            ),
            (want.to_owned(), want.to_owned()),
            "{prompt}"
        );
        // The threshold rule commits several positions a forward: fewer forwards.
        assert!(
            b["stats"]["forward_passes"].as_u64() < a["stats"]["forward_passes"].as_u64(),
            "{a} {b}"
        );
    }
}

#[test]
fn the_trained_huginn_sorts_held_out_digits_with_static_recurrence() {
    // Static depth at the checkpoint's mean recurrence; a fixed seed fixes the initial states.
    for (prompt, want) in [
        ("sort 9 0 1 8 =", " 0 1 8 9"),
        ("sort 6 8 2 3 7 =", " 2 3 6 7 8"),
    ] {
        assert_eq!(answer("huginn-tiny", prompt, &HUGINN_AR), want, "{prompt}");
    }
}

fn text_request(
    model: &str,
    prompt: &str,
    scheme: pb::generate_request::Scheme,
) -> pb::GenerateRequest {
    pb::GenerateRequest {
        model: model.into(),
        prompt: Some(pb::generate_request::Prompt::Text(prompt.into())),
        max_new_tokens: 16,
        sampling: Some(pb::SamplingParams {
            seed: Some(0),
            ..Default::default()
        }),
        scheme: Some(scheme),
        ..Default::default()
    }
}

#[tokio::test]
async fn serve_brings_up_the_four_trained_models_and_defaults_to_huginn() {
    // No --model: the embedded checkpoints, one in-process worker each, behind the router.
    let serve = spawn(&["serve", "--listen", "127.0.0.1:0"]);
    wait_serving(serve.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(serve.addr).await);
    let mut models: Vec<(String, String)> = served_models(&mut client)
        .await
        .into_iter()
        .map(|m| (m.name, m.family))
        .collect();
    models.sort();
    let want = [
        ("armt", "recurrent_memory"),
        ("huginn", "recurrent_depth"),
        ("llada", "masked_diffusion"),
        ("refusion", "slot_diffusion"),
    ];
    assert_eq!(
        models,
        want.map(|(n, f)| (n.to_owned(), f.to_owned())).to_vec()
    );

    // A request naming no model is Huginn's, and answers as `run` does on models/huginn-tiny.
    let ask = |model: &'static str, prompt: &'static str, scheme| {
        let mut client = client.clone();
        async move {
            client
                .generate(text_request(model, prompt, scheme))
                .await
                .expect("generate")
                .into_inner()
        }
    };
    let ar = pb::generate_request::Scheme::Ar(pb::ArScheme {
        num_steps: Some(8),
        ..Default::default()
    });
    // The others by name.
    let lc = pb::generate_request::Scheme::LowConfidence(pb::LowConfidenceScheme {
        block_length: Some(16),
        steps: Some(16),
        ..Default::default()
    });
    let pi = pb::generate_request::Scheme::PlanInfill(pb::PlanInfillScheme::default());
    for (asked, served, prompt, scheme, run_args) in [
        ("", "huginn", "sort 9 0 1 8 =", ar, &HUGINN_AR[..]),
        // (the session-13 checkpoint answered " 0 1 1 8 9 9" here: a stale embedded copy fails)
        ("llada", "llada", "sort 9 0 1 8 =", lc, &LLADA_LC[..]),
        (
            "refusion",
            "refusion",
            "sort 6 8 2 3 7 =",
            pi,
            &REFUSION_PI[..],
        ),
    ] {
        let r = ask(asked, prompt, scheme).await;
        assert_eq!(r.model, served);
        assert_eq!(
            cut(&r.text),
            answer(&format!("{served}-tiny"), prompt, run_args)
        );
        // Each checkpoint's end token (Huginn's eos_token_id, <|end_text|>) ends the answer.
        assert_eq!(r.finish_reason, pb::FinishReason::StopToken as i32, "{r:?}");
    }
}

#[test]
fn the_trained_refusion_sorts_held_out_digits_with_plan_and_infill() {
    for (prompt, want) in [
        ("sort 9 0 1 8 =", " 0 1 8 9"),
        ("sort 6 8 2 3 7 =", " 2 3 6 7 8"),
    ] {
        assert_eq!(
            answer("refusion-tiny", prompt, &REFUSION_PI),
            want,
            "{prompt}"
        );
    }
}

#[test]
fn the_trained_armt_recalls_a_fact_from_three_segments_back_in_either_execution() {
    // One fact in the first segment, prose, and its question in the fourth (segments of 64):
    // only the memory carries the fact that far. (With two facts the checkpoint answers one of
    // the two values whichever key is asked: training/README.md.)
    let prose = include_str!("../../training/testdata/web-slice.txt");
    for (key, value) in [("q", 5), ("d", 7), ("x", 0)] {
        let prompt = format!(
            "{} The key {key} is {value}. {} The key {key} is",
            &prose[..300],
            &prose[300..1000]
        );
        let args = |execution| ["--max-new-tokens", "3", "--execution", execution];
        let seq = run_json("armt-tiny", &prompt, &args("sequential"));
        let diag = run_json("armt-tiny", &prompt, &args("diagonal"));
        assert!(
            seq["stats"]["prompt_tokens"].as_u64().unwrap() > 3 * 64,
            "{seq}"
        );
        assert_eq!(seq["token_ids"], diag["token_ids"]);
        assert_eq!(seq["text"], format!(" {value}."), "key {key}");
    }
}

#[test]
fn the_readme_prose_exchanges_are_what_run_writes_and_the_readme_shows_them() {
    // The README's prose rows (greedy; Huginn seeded 0), with the settings its table names.
    let readme = include_str!("../../README.md");
    let rows: [(&str, &str, &[&str], &str); 4] = [
        (
            "huginn-tiny",
            "And the king said to",
            &["--num-steps", "8", "--seed", "0", "--max-new-tokens", "24"],
            " the king, \"Go up, and let the king be king over the king.\" The king said to the king,",
        ),
        (
            "llada-tiny",
            "And the king said to",
            &[
                "--scheme",
                "low-confidence",
                "--steps",
                "32",
                "--block-length",
                "8",
                "--max-new-tokens",
                "32",
            ],
            " him, \"Is the king, and the king of Israel, and the king of the king of Judah, and the king of Judah, and to the",
        ),
        (
            "refusion-tiny",
            "In the beginning God created",
            &["--scheme", "plan-infill", "--max-new-tokens", "16"],
            " me, and I will not know my name. I will not know my name",
        ),
        (
            "armt-tiny",
            "And the king said to",
            &["--scheme", "ar", "--max-new-tokens", "24"],
            " the king, \"I will go with you, and I will give you a land that I have built for you,",
        ),
    ];
    for (name, prompt, args, want) in rows {
        assert_eq!(answer(name, prompt, args), want, "{name}: {prompt}");
        // One table row holds the family, the prompt and this answer.
        let family = name.trim_end_matches("-tiny");
        assert!(
            readme.lines().any(|l| {
                l.starts_with(&format!("| {family} | `{prompt}` |"))
                    && l.ends_with(&format!("| `{want}` |"))
            }),
            "README.md has no {family} row for {prompt:?} answering {want:?}"
        );
    }
}

/// The newcomer's path (issue 42, N1 and N5): the text leaves out the end-of-text token
/// unless `--keep-special-tokens` asks for it (token ids keep it either way); `run` finds an
/// embedded model by the name given to `--model-name` or `--model`, refuses a `--model-name`
/// that is not the model it runs, and says once, with a hint, that a Hugging Face id is not a
/// directory.
#[test]
fn text_leaves_out_special_tokens_and_run_finds_embedded_models_by_name() {
    let run = |args: &[&str]| {
        Command::new(bin())
            .arg("run")
            .args(["--log-filter", "warn"])
            .args(args)
            .output()
            .expect("run wavefront run")
    };
    let sort = ["--prompt", "sort 9 0 1 8 =", "--num-steps", "8"];
    let sort = [
        &sort[..],
        &["--max-new-tokens", "16", "--seed", "0", "--json"],
    ]
    .concat();
    let plain = json_result(&run(&sort));
    assert_eq!(plain["text"], " 0 1 8 9", "{plain}");
    let kept = json_result(&run(&[&sort[..], &["--keep-special-tokens"]].concat()));
    assert_eq!(kept["text"], " 0 1 8 9<|end_text|>", "{kept}");
    assert_eq!(plain["token_ids"], kept["token_ids"]);

    for flag in ["--model-name", "--model"] {
        let out = run(&[
            flag,
            "llada",
            "--prompt",
            "copy i r q c =",
            "--max-new-tokens",
            "16",
            "--json",
        ]);
        let r = json_result(&out);
        assert_eq!(r["text"], " i r q c", "{flag}: {r}");
        // Masked diffusion commits per step and counts blocks; Huginn would recur.
        assert!(
            r["stats"]["series"].get("committed_per_step").is_some()
                && r["stats"]["counters"]["blocks"] == 1,
            "{flag}: not llada's answer: {r}"
        );
    }
    let out = run(&[
        "--model",
        "huginn",
        "--model-name",
        "llada",
        "--prompt",
        "x",
        "--max-new-tokens",
        "2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("is not the model this runs"), "{err}");
    let out = run(&[
        "--model",
        "GSAI-ML/LLaDA-8B-Instruct",
        "--prompt",
        "x",
        "--max-new-tokens",
        "2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Hugging Face id"), "{err}");
    let empty = std::env::temp_dir().join(format!("wavefront-empty-model-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = run(&[
        "--model",
        empty.to_str().unwrap(),
        "--prompt",
        "x",
        "--max-new-tokens",
        "2",
    ]);
    let _ = std::fs::remove_dir(&empty);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.matches("No such file or directory").count(),
        1,
        "the cause said once: {err}"
    );
}

/// `export-gguf` writes each trained model as one GGUF file that `run` and `serve` load by
/// path: float32 gives the directory's tokens exactly; Q8_0 (about a quarter of the bytes)
/// still answers the held-out prompts, and through `serve` under the file's name.
#[tokio::test]
async fn trained_models_exported_to_gguf_answer_as_their_directories() {
    let dir = std::env::temp_dir().join(format!("wavefront-e2e-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases: [(&str, &[&str], &str, &str); 2] = [
        ("llada-tiny", &LLADA_LC, "sort 9 0 1 8 =", " 0 1 8 9"),
        ("huginn-tiny", &HUGINN_AR, "sort 6 8 2 3 7 =", " 2 3 6 7 8"),
    ];
    for (name, args, prompt, want) in cases {
        for quant in ["f32", "q8_0"] {
            let file = dir.join(format!("{name}-{quant}.gguf"));
            let out = Command::new(bin())
                .args(["export-gguf", "--model", model(name).to_str().unwrap()])
                .args(["--out", file.to_str().unwrap(), "--type", quant])
                .output()
                .expect("run export-gguf");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let from_file = Command::new(bin())
                .args(["run", "--model", file.to_str().unwrap(), "--json"])
                .args(["--log-filter", "warn", "--prompt", prompt])
                .args(args)
                .output()
                .expect("run wavefront run");
            let got = json_result(&from_file);
            if quant == "f32" {
                assert_eq!(got["token_ids"], run_json(name, prompt, args)["token_ids"]);
            }
            assert_eq!(cut(got["text"].as_str().unwrap()), want, "{name} {quant}");
        }
    }
    // Served by path, named after the file.
    let file = dir.join("llada-tiny-q8_0.gguf");
    let serve = spawn(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--model",
        file.to_str().unwrap(),
    ]);
    wait_serving(serve.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(serve.addr).await);
    let scheme = pb::generate_request::Scheme::LowConfidence(pb::LowConfidenceScheme {
        steps: Some(16),
        block_length: Some(16),
        ..Default::default()
    });
    let r = client
        .generate(text_request("llada-tiny-q8_0", "sort 9 0 1 8 =", scheme))
        .await
        .expect("generate")
        .into_inner();
    assert_eq!(cut(&r.text), " 0 1 8 9");
    drop(serve);
    std::fs::remove_dir_all(&dir).unwrap();
}
