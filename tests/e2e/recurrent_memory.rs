//! The recurrent-memory (ARMT) fixture end to end: `wavefront run` with each execution mode
//! reproduces upstream's greedy tokens, the context limit comes from the environment, and a
//! worker serving the model answers the same tokens over gRPC with an unknown execution mode
//! refused as INVALID_ARGUMENT.

use tonic::Code;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{
    channel, fixture, json_result, served_models, spawn_worker, wait_serving, wavefront_run,
    wavefront_run_with_env,
};

/// The fixture's 44 input ids and upstream's 8 greedy tokens after them (golden.json).
fn golden() -> (Vec<u32>, Vec<u32>) {
    let path = fixture("armt").join("golden.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("golden.json")).expect("json");
    let ids = serde_json::from_value(json["input_ids"].clone()).expect("input_ids");
    let tokens = serde_json::from_value(json["generation"]["seq_tokens"].clone()).expect("tokens");
    (ids, tokens)
}

#[test]
fn run_reproduces_upstream_generation_with_each_execution_mode() {
    let (ids, want) = golden();
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    for (execution, steps) in [("sequential", 18), ("diagonal", 8), ("auto", 8)] {
        let json = json_result(&wavefront_run(
            "armt",
            &[
                "--scheme",
                "ar",
                "--execution",
                execution,
                "--prompt-ids",
                &ids,
                "--max-new-tokens",
                "8",
            ],
        ));
        let tokens: Vec<u32> = serde_json::from_value(json["token_ids"].clone()).expect("ids");
        assert_eq!(tokens, want, "{execution}");
        let stats = &json["stats"];
        assert_eq!(stats["counters"]["segments"], 6, "{execution}");
        assert_eq!(stats["counters"]["grouped_steps"], steps, "{execution}");
        assert!(stats["series"]["cells_per_step"].is_array());
    }
    // The context limit is the configured one (44 + 8 > 40), not the backbone's.
    let out = wavefront_run_with_env(
        "armt",
        &["--prompt-ids", &ids, "--max-new-tokens", "8"],
        &[("WAVEFRONT_MAX_CONTEXT_TOKENS", "40")],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("context limit is 40"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serves_the_armt_fixture() {
    let (ids, want) = golden();
    let worker = spawn_worker("armt", &["--max-context-tokens", "100000"]);
    wait_serving(worker.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(worker.addr).await);
    let models = served_models(&mut client).await;
    assert_eq!(models[0].family, "recurrent_memory");
    assert_eq!(models[0].max_context, 100_000);
    let request = |execution: &str| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
            ids: ids.clone(),
        })),
        max_new_tokens: 8,
        scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
            execution: execution.into(),
            ..Default::default()
        })),
        ..Default::default()
    };
    for execution in ["diagonal", "sequential"] {
        let r = client
            .generate(request(execution))
            .await
            .expect("generate")
            .into_inner();
        assert_eq!(r.token_ids, want, "{execution}");
        let stats = r.stats.expect("stats");
        assert_eq!(stats.counters["segments"], 6);
    }
    let err = client.generate(request("pipelined")).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
}
