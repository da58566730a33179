//! DiffusionGemma end to end: `wavefront run --replay-draws golden.safetensors --replay-run NAME`
//! reproduces every one-row run of the fixture (upstream's whole canvases with
//! `--whole-canvases`; cut at `--max-new-tokens` and the first end of sequence without), a chat
//! prompt through the Gemma 4 template included; a worker serving the model lists its family and
//! scheme, streams canvas events, gives a seed's tokens again, and refuses bad input by name.

use tonic::Code;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{
    channel, fixture, json_lines, served_models, spawn_worker, wait_serving, wavefront_run,
};

fn golden() -> serde_json::Value {
    let path = fixture("diffusion_gemma").join("golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("golden.json")).expect("json")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("ids")
}

fn tokens(out: &std::process::Output) -> Vec<u32> {
    let lines = json_lines(out);
    serde_json::from_value(lines.last().expect("result")["token_ids"].clone()).expect("tokens")
}

/// The run's flags, as the fixture's kwargs name them.
fn run_flags(run: &serde_json::Value) -> Vec<String> {
    let kw = &run["kwargs"];
    let mut a = vec![
        "--scheme".to_owned(),
        "entropy-bound".to_owned(),
        "--max-new-tokens".to_owned(),
        kw["max_new_tokens"].to_string(),
    ];
    for key in [
        "max_denoising_steps",
        "t_max",
        "t_min",
        "entropy_bound",
        "stability_threshold",
        "confidence_threshold",
    ] {
        match &kw[key] {
            serde_json::Value::Null if kw.get(key).is_some() => a.push("--no-early-stop".into()),
            serde_json::Value::Null => {}
            v => a.extend([format!("--{}", key.replace('_', "-")), v.to_string()]),
        }
    }
    if let Some(canvas) = run["initial_canvas_passed"].as_array() {
        let c: Vec<String> = ids(&canvas[0]).iter().map(u32::to_string).collect();
        a.extend(["--initial-canvas".to_owned(), c.join(",")]);
    }
    a
}

#[test]
fn run_replays_every_recorded_run() {
    let g = golden();
    let draws = fixture("diffusion_gemma").join("golden.safetensors");
    for run in g["runs"].as_array().expect("runs") {
        let name = run["name"].as_str().expect("name");
        let input = &run["input_ids"];
        if input.as_array().expect("rows").len() != 1 {
            continue; // the batch run: its rows are requests of the scheme's own golden test
        }
        let prompt = ids(&input[0]);
        let p: Vec<String> = prompt.iter().map(u32::to_string).collect();
        let mut args = run_flags(run);
        args.extend([
            "--prompt-ids".to_owned(),
            p.join(","),
            "--replay-draws".to_owned(),
            draws.to_str().expect("path").to_owned(),
            "--replay-run".to_owned(),
            name.to_owned(),
        ]);
        let whole = ids(&run["sequences"][0])[prompt.len()..].to_vec();
        let mut upstream = args.clone();
        upstream.push("--whole-canvases".into());
        assert_eq!(
            tokens(&wavefront_run("diffusion_gemma", &upstream)),
            whole,
            "{name}"
        );
        // By default: the answer up to the first end of sequence, at most max_new_tokens.
        let eos = [1u32, 16, 9];
        let max_new = run["kwargs"]["max_new_tokens"].as_u64().expect("max") as usize;
        let cut = match whole.iter().position(|t| eos.contains(t)) {
            Some(e) if e < max_new => whole[..=e].to_vec(),
            _ => whole[..max_new].to_vec(),
        };
        assert_eq!(
            tokens(&wavefront_run("diffusion_gemma", &args)),
            cut,
            "{name}"
        );
    }
    // A chat prompt rendered with the model's template gives the run's tokens.
    let run = &g["runs"][0];
    let mut args = run_flags(run);
    args.extend([
        "--prompt".to_owned(),
        "What is free software?".to_owned(),
        "--chat".to_owned(),
        "--whole-canvases".to_owned(),
        "--replay-draws".to_owned(),
        draws.to_str().expect("path").to_owned(),
        "--replay-run".to_owned(),
        "default.chat".to_owned(),
    ]);
    let out = wavefront_run("diffusion_gemma", &args);
    assert_eq!(tokens(&out), ids(&run["generated_ids"][0]));
    // Replaying a two-row run is refused with the reason.
    let out = wavefront_run(
        "diffusion_gemma",
        &[
            "--scheme",
            "entropy-bound",
            "--max-new-tokens",
            "16",
            "--prompt-ids",
            "2,15",
            "--replay-draws",
            draws.to_str().expect("path"),
            "--replay-run",
            "batch2_leftpad_stab0_conf0.6.chat",
        ],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("2 rows"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_worker_serves_diffusion_gemma_with_canvas_events_and_precise_refusals() {
    let worker = spawn_worker("diffusion_gemma", &[]);
    wait_serving(worker.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(worker.addr).await);
    let models = served_models(&mut client).await;
    assert_eq!(models[0].family, "uniform_diffusion");
    assert_eq!(models[0].schemes, vec!["entropy-bound"]);
    let chat = pb::ChatMessages {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "What is free software?".into(),
        }],
    };
    let request = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Chat(chat)),
        max_new_tokens: 24,
        stream_canvas: true,
        sampling: Some(pb::SamplingParams {
            seed: Some(7),
            ..Default::default()
        }),
        // No scheme: the model's own, with generation_config.json's settings.
        ..Default::default()
    };
    let mut answers = Vec::new();
    for _ in 0..2 {
        let mut stream = client
            .generate_stream(request.clone())
            .await
            .expect("stream")
            .into_inner();
        let (mut streamed, mut frames, mut steps) = (Vec::new(), 0u64, 0u64);
        while let Some(msg) = stream.message().await.expect("message") {
            match msg.event {
                Some(pb::generate_stream_response::Event::Tokens(t)) => {
                    streamed.extend(t.token_ids)
                }
                Some(pb::generate_stream_response::Event::Canvas(_)) => frames += 1,
                Some(pb::generate_stream_response::Event::Done(d)) => {
                    steps = d.stats.expect("stats").counters["denoising_steps"];
                }
                _ => {}
            }
        }
        assert!(!streamed.is_empty() && streamed.len() <= 24);
        assert_eq!(frames, steps, "one canvas event per denoising step");
        answers.push(streamed);
    }
    assert_eq!(answers[0], answers[1], "a seed gives its tokens again");
    let refused = |mut r: pb::GenerateRequest, f: &dyn Fn(&mut pb::GenerateRequest)| {
        f(&mut r);
        r
    };
    for (bad, needle) in [
        (
            refused(request.clone(), &|r| {
                r.scheme = Some(pb::generate_request::Scheme::EntropyBound(
                    pb::EntropyBoundScheme {
                        t_max: Some(0.0),
                        ..Default::default()
                    },
                ))
            }),
            "entropy_bound.t_max",
        ),
        (
            refused(request.clone(), &|r| {
                r.sampling = Some(pb::SamplingParams {
                    temperature: 0.7,
                    ..Default::default()
                })
            }),
            "t_max and t_min",
        ),
        (
            refused(request.clone(), &|r| {
                r.prompt = Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
                    ids: vec![2, 17, 19, 18],
                }))
            }),
            "image",
        ),
        (
            refused(request.clone(), &|r| {
                r.scheme = Some(pb::generate_request::Scheme::BlockDiffusion(
                    Default::default(),
                ))
            }),
            "entropy-bound",
        ),
    ] {
        let err = client.generate(bad).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{needle}: {err}");
        assert!(err.message().contains(needle), "{needle}: {err}");
    }
}
