//! Dream and LLaDA2.0 end to end: `wavefront run` reproduces upstream's answers from the command
//! line (`--scheme diffusion-generate`, `--scheme block-diffusion`, LLaDA2.0 split over two
//! expert-parallel ranks and through the ragged attention path), and a worker serving each model
//! lists it, streams a chat request to upstream's answer with canvas events, and refuses a bad
//! parameter as INVALID_ARGUMENT naming it.

use tonic::Code;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{
    channel, fixture, json_lines, served_models, spawn_worker, wait_serving, wavefront_run,
    wavefront_run_with_env,
};

fn golden(name: &str) -> serde_json::Value {
    let path = fixture(name).join("golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("golden.json")).expect("json")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("ids")
}

/// Dream's entropy chat run: the generated tokens up to and with the first `<|endoftext|>`.
fn dream_answer() -> (Vec<u32>, Vec<u32>) {
    let g = golden("dream");
    let run = g["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "entropy.chat.n32.s16")
        .unwrap()
        .clone();
    let prompt = ids(&run["input_ids"][0]);
    let eos = run["eos_positions"][0][0].as_u64().unwrap() as usize;
    let answer = ids(&run["output_ids"][0])[prompt.len()..=eos].to_vec();
    (prompt, answer)
}

fn llada2_run(name: &str) -> serde_json::Value {
    golden("llada2")["generate_runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap()
        .clone()
}

fn llada2_flags(run: &serde_json::Value) -> Vec<String> {
    let a = &run["args"];
    let prompt: Vec<String> = ids(&run["prompt_ids"]).iter().map(u32::to_string).collect();
    let mut flags: Vec<String> = [
        ("--scheme", "block-diffusion".to_owned()),
        ("--prompt-ids", prompt.join(",")),
        ("--max-new-tokens", a["gen_length"].to_string()),
        ("--block-length", a["block_length"].to_string()),
        ("--steps", a["steps"].to_string()),
        ("--threshold", a["threshold"].to_string()),
        ("--minimal-topk", a["minimal_topk"].to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_owned(), v])
    .collect();
    if a["eos_early_stop"] == true {
        flags.push("--eos-early-stop".into());
    }
    flags
}

fn tokens(out: &std::process::Output) -> Vec<u32> {
    let lines = json_lines(out);
    serde_json::from_value(lines.last().expect("result")["token_ids"].clone()).expect("tokens")
}

#[test]
fn run_reproduces_dream_and_llada2() {
    let (_, answer) = dream_answer();
    let out = wavefront_run(
        "dream",
        &[
            "--prompt",
            "What is free software?",
            "--chat",
            "--scheme",
            "diffusion-generate",
            "--alg",
            "entropy",
            "--steps",
            "16",
            "--top-k",
            "50",
            "--max-new-tokens",
            "32",
        ],
    );
    assert_eq!(tokens(&out), answer);

    for name in [
        "A_bl16_s4_t0.7",
        "E_bl8_s8_t0.7_early",
        "CHAT_bl16_s16_t0.8",
    ] {
        let run = llada2_run(name);
        let mut want = ids(&run["output_ids"]);
        if run["output_includes_prompt"] == true {
            want.drain(..ids(&run["prompt_ids"]).len());
        }
        let flags = llada2_flags(&run);
        assert_eq!(tokens(&wavefront_run("llada2", &flags)), want, "{name}");
        // Experts and heads over two ranks, and every sequence in one ragged operation.
        let mut split = flags.clone();
        split.extend(["--tensor-parallel".into(), "2".into()]);
        assert_eq!(
            tokens(&wavefront_run("llada2", &split)),
            want,
            "{name}, 2 ranks"
        );
        let ragged = wavefront_run_with_env("llada2", &flags, &[("WAVEFRONT_ATTENTION", "ragged")]);
        assert_eq!(tokens(&ragged), want, "{name}, ragged attention");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_serve_dream_and_llada2_over_grpc() {
    let (_, answer) = dream_answer();
    let chat = pb::ChatMessages {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "What is free software?".into(),
        }],
    };
    let worker = spawn_worker("dream", &[]);
    wait_serving(worker.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(worker.addr).await);
    let models = served_models(&mut client).await;
    assert_eq!(models[0].family, "masked_diffusion");
    assert_eq!(
        models[0].schemes,
        vec!["diffusion-generate", "low-confidence"]
    );
    let request = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Chat(chat.clone())),
        max_new_tokens: 32,
        stream_canvas: true,
        sampling: Some(pb::SamplingParams {
            top_k: 50,
            ..Default::default()
        }),
        scheme: Some(pb::generate_request::Scheme::DiffusionGenerate(
            pb::DiffusionGenerateScheme {
                alg: "entropy".into(),
                steps: Some(16),
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let mut stream = client
        .generate_stream(request.clone())
        .await
        .expect("stream")
        .into_inner();
    let (mut streamed, mut frames) = (Vec::new(), 0);
    while let Some(msg) = stream.message().await.expect("message") {
        match msg.event {
            Some(pb::generate_stream_response::Event::Tokens(t)) => streamed.extend(t.token_ids),
            Some(pb::generate_stream_response::Event::Canvas(_)) => frames += 1,
            _ => {}
        }
    }
    assert_eq!(streamed, answer);
    assert!(frames > 0, "canvas events were asked for");
    let mut bad = request.clone();
    bad.scheme = Some(pb::generate_request::Scheme::DiffusionGenerate(
        pb::DiffusionGenerateScheme {
            eps: Some(2.0),
            ..Default::default()
        },
    ));
    let err = client.generate(bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("diffusion_generate.eps"), "{err}");
    drop(worker);

    let run = llada2_run("CHAT_bl16_s16_t0.8");
    let worker = spawn_worker("llada2", &[]);
    wait_serving(worker.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(worker.addr).await);
    let a = &run["args"];
    let request = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
            ids: ids(&run["prompt_ids"]),
        })),
        max_new_tokens: a["gen_length"].as_u64().unwrap() as u32,
        scheme: Some(pb::generate_request::Scheme::BlockDiffusion(
            pb::BlockDiffusionScheme {
                block_length: Some(16),
                steps: Some(16),
                threshold: Some(0.8),
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let response = client
        .generate(request.clone())
        .await
        .expect("generate")
        .into_inner();
    assert_eq!(response.token_ids, ids(&run["output_ids"]));
    assert_eq!(response.finish_reason, pb::FinishReason::StopToken as i32);
    let mut bad = request;
    bad.scheme = Some(pb::generate_request::Scheme::BlockDiffusion(
        pb::BlockDiffusionScheme {
            block_length: Some(0),
            ..Default::default()
        },
    ));
    let err = client.generate(bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("block_diffusion.block_length"),
        "{err}"
    );
}

/// `wavefront run` with Fast-dLLM's flags reproduces Fast-dLLM's own runs on the LLaDA
/// fixture: the tokens, and the forwards (with `--upstream-calls`, upstream's count; without
/// it, the same tokens).
#[test]
fn run_reproduces_fast_dllm_caches_and_threshold() {
    let g = golden("fast_dllm");
    let runs = g["runs"].as_array().expect("runs");
    for name in [
        "raw.prefix.g32.b8.s4.t0.9",
        "raw.dual.g64.b16.s4.t0.5",
        "chat.dual.g32.b8.s32",
        "raw.generate.g32.b8.s4.t0.5",
    ] {
        let run = runs.iter().find(|r| r["name"] == name).expect(name);
        let prompt = &g["prompts"][run["prompt"].as_str().expect("prompt")];
        let prompt = ids(if prompt.is_array() {
            prompt
        } else {
            &prompt["ids"]
        });
        let cache = match run["method"].as_str().expect("method") {
            "generate_with_prefix_cache" => "prefix",
            "generate_with_dual_cache" => "dual",
            _ => "none",
        };
        let prompt: Vec<String> = prompt.iter().map(u32::to_string).collect();
        let mut args: Vec<String> = [
            ("--scheme", "low-confidence".to_owned()),
            ("--prompt-ids", prompt.join(",")),
            ("--max-new-tokens", run["gen_length"].to_string()),
            ("--block-length", run["block_length"].to_string()),
            ("--steps", run["steps"].to_string()),
            ("--kv-cache", cache.to_owned()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect();
        if let Some(t) = run["threshold"].as_f64() {
            args.extend(["--threshold".to_owned(), t.to_string()]);
        }
        let want = ids(&run["generated_ids"]);
        for upstream in [true, false] {
            let mut a = args.clone();
            if upstream && cache != "none" {
                a.push("--upstream-calls".into());
            }
            let out = wavefront_run("llada", &a);
            assert!(
                out.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(tokens(&out), want, "{name}");
            let lines = json_lines(&out);
            let forwards = lines.last().expect("result")["stats"]["forward_passes"]
                .as_u64()
                .expect("forwards");
            if upstream || cache == "none" {
                assert_eq!(forwards, run["nfe"].as_u64().unwrap(), "{name}");
            } else {
                assert!(forwards <= run["nfe"].as_u64().unwrap(), "{name}");
            }
        }
    }
}
