//! The slot-diffusion (ReFusion) fixture end to end: `wavefront run --scheme plan-infill`
//! reproduces upstream's responses, prints the out-of-order slot events with `--stream-canvas`,
//! and decodes the same split over two tensor-parallel ranks; a worker serving the model streams
//! tokens in position order with slot events ahead of them, and refuses a slot size of 0 as
//! INVALID_ARGUMENT.

use tonic::Code;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{
    channel, fixture, json_lines, served_models, spawn_worker, wait_serving, wavefront_run,
    wavefront_run_with_env,
};

const EOS: u32 = 486;

/// A golden `generate_refusion()` run: prompt, settings and the response (generated tokens in
/// position order, cut after the first EOS).
struct Run {
    prompt: Vec<u32>,
    args: serde_json::Value,
    response: Vec<u32>,
    /// Positions (from the first generated one) committed by each iteration.
    commits: Vec<Vec<u32>>,
}

fn golden_run(name: &str) -> Run {
    let path = fixture("refusion").join("golden.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("golden.json")).expect("json");
    let run = json["generate"]
        .as_array()
        .expect("runs")
        .iter()
        .find(|r| r["name"] == name)
        .expect("run")
        .clone();
    let vec = |v: &serde_json::Value| -> Vec<u32> { serde_json::from_value(v.clone()).unwrap() };
    let prompt = vec(&run["prompt_ids"]);
    let mut pairs: Vec<(u32, u32)> = vec(&run["generated_positions"])
        .into_iter()
        .zip(vec(&run["generated_ids"]))
        .collect();
    pairs.sort_unstable();
    let mut response = Vec::new();
    for (_, t) in pairs {
        response.push(t);
        if t == EOS {
            break;
        }
    }
    let commits = run["trace"]
        .as_array()
        .expect("trace")
        .iter()
        .map(|it| {
            vec(&it["committed_pos"])
                .iter()
                .map(|p| p - prompt.len() as u32)
                .collect()
        })
        .collect();
    Run {
        prompt,
        args: run["args"].clone(),
        response,
        commits,
    }
}

/// `wavefront run` flags of the golden run with `plan-infill`.
fn flags(run: &Run) -> Vec<String> {
    let a = &run.args;
    let ids: Vec<String> = run.prompt.iter().map(u32::to_string).collect();
    [
        ("--scheme", "plan-infill".to_owned()),
        ("--prompt-ids", ids.join(",")),
        ("--max-new-tokens", a["gen_length"].to_string()),
        ("--slot-size", a["slot_size"].to_string()),
        ("--serial-num-blocks", a["serial_num_blocks"].to_string()),
        ("--slot-threshold", a["slot_threshold"].to_string()),
        ("--token-threshold", a["token_threshold"].to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_owned(), v])
    .collect()
}

#[test]
fn run_reproduces_upstream_and_prints_slot_events() {
    for name in ["main_b16", "paper_b16", "eos_prefix_b16"] {
        let golden = golden_run(name);
        let mut args = flags(&golden);
        args.push("--stream-canvas".into());
        let lines = json_lines(&wavefront_run("refusion", &args));
        let (result, canvas) = lines.split_last().expect("output");
        let tokens: Vec<u32> = serde_json::from_value(result["token_ids"].clone()).unwrap();
        assert_eq!(tokens, golden.response, "{name}");
        assert_eq!(
            result["stats"]["counters"]["iterations"],
            golden.commits.len(),
            "{name}"
        );
        // One slot event per iteration with upstream's committed positions, in commit order.
        let positions: Vec<Vec<u32>> = canvas
            .iter()
            .map(|l| serde_json::from_value(l["canvas"]["positions"].clone()).unwrap())
            .collect();
        assert_eq!(positions, golden.commits, "{name}");
        for l in canvas {
            assert_eq!(l["canvas"]["full"], false);
            assert!(l["canvas"]["states"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s == "committed"));
        }
    }
    // Split over two in-process tensor-parallel ranks: the same response.
    let golden = golden_run("main_b16");
    let mut args = flags(&golden);
    args.extend(["--tensor-parallel".into(), "2".into()]);
    let lines = json_lines(&wavefront_run("refusion", &args));
    let tokens: Vec<u32> = serde_json::from_value(lines[0]["token_ids"].clone()).unwrap();
    assert_eq!(tokens, golden.response);
    // Every forward's sequences in one ragged attention operation (WAVEFRONT_ATTENTION as
    // the deployment sets it), split or not: the same response.
    for tp in ["1", "2"] {
        let mut ragged = flags(&golden);
        ragged.extend(["--tensor-parallel".into(), tp.into()]);
        let out = wavefront_run_with_env("refusion", &ragged, &[("WAVEFRONT_ATTENTION", "ragged")]);
        let lines = json_lines(&out);
        let tokens: Vec<u32> = serde_json::from_value(lines[0]["token_ids"].clone()).unwrap();
        assert_eq!(tokens, golden.response, "ragged attention, {tp} rank(s)");
    }
    // An unknown kernel is refused at start-up with the choices.
    let mut bad = flags(&golden);
    bad.extend(["--attention".into(), "flash".into()]);
    let out = wavefront_run("refusion", &bad);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "--attention: unknown attention kernel \"flash\": expected one of sdpa, ragged"
        ),
        "{err}"
    );
    // Recurrent depth keeps its own attention path and says so.
    let out = wavefront_run(
        "huginn",
        &[
            "--attention",
            "ragged",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "1",
        ],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("huginn (recurrent depth) attends with sdpa only"),
        "{err}"
    );
    // NCCL joins GPUs only: asked for on the CPU, the run refuses at start-up and says why.
    args.extend(["--collective".into(), "nccl".into()]);
    let out = wavefront_run("refusion", &args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--collective nccl needs --device cuda:N"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_streams_slots_in_position_order_with_slot_events_ahead() {
    let worker = spawn_worker("refusion", &[]);
    wait_serving(worker.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(worker.addr).await);
    let models = served_models(&mut client).await;
    assert_eq!(models[0].family, "slot_diffusion");
    assert_eq!(models[0].schemes, vec!["plan-infill", "ar"]);

    let golden = golden_run("main_b32");
    let a = &golden.args;
    let scheme = |slot_size: u32| {
        pb::generate_request::Scheme::PlanInfill(pb::PlanInfillScheme {
            slot_size: Some(slot_size),
            serial_num_blocks: a["serial_num_blocks"].as_u64().map(|v| v as u32),
            slot_threshold: a["slot_threshold"].as_f64().map(|v| v as f32),
            token_threshold: a["token_threshold"].as_f64().map(|v| v as f32),
        })
    };
    let request = |slot_size| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
            ids: golden.prompt.clone(),
        })),
        max_new_tokens: a["gen_length"].as_u64().unwrap() as u32,
        scheme: Some(scheme(slot_size)),
        stream_canvas: true,
        ..Default::default()
    };
    let mut stream = client
        .generate_stream(request(a["slot_size"].as_u64().unwrap() as u32))
        .await
        .expect("stream")
        .into_inner();
    let (mut tokens, mut commits, mut ahead, mut done) = (Vec::new(), Vec::new(), false, None);
    let mut final_positions = std::collections::BTreeSet::new();
    while let Some(msg) = stream.message().await.expect("message") {
        match msg.event.expect("event") {
            pb::generate_stream_response::Event::Canvas(c) => {
                ahead |= c.positions.iter().all(|&p| p as usize > tokens.len());
                final_positions.extend(c.positions.iter().copied());
                commits.push(c.positions);
            }
            pb::generate_stream_response::Event::Tokens(t) => {
                for id in t.token_ids {
                    // Streamed in position order, only once its slot was committed.
                    assert!(final_positions.contains(&(tokens.len() as u32)));
                    tokens.push(id);
                }
            }
            pb::generate_stream_response::Event::Done(d) => done = Some(d),
            pb::generate_stream_response::Event::Prompt(_) => panic!("no prompt scores asked for"),
        }
    }
    assert_eq!(tokens, golden.response);
    assert_eq!(commits, golden.commits);
    assert!(
        ahead,
        "some slot was committed ahead of the in-order stream"
    );
    assert_eq!(done.expect("done").token_ids, golden.response);

    // max_new_tokens is a cap: slots of 5 over 32 tokens decode a canvas rounded up to whole
    // blocks of whole slots and answer at most 32 tokens.
    let capped = client
        .generate(request(5))
        .await
        .expect("served")
        .into_inner();
    assert!(capped.token_ids.len() <= 32, "{}", capped.token_ids.len());
    // A parameter that cannot work is refused with the rule it breaks.
    let err = client.generate(request(0)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message()
            .contains("plan_infill.slot_size must be at least 1"),
        "{err:?}"
    );
}
