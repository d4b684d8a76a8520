//! The external-trainer API through the Python package (`node/python`, numpy path): its example
//! trains the MNIST MLP through a real node, pushing updates and applying merged ones; and the
//! package's own tests (errors, retries, the torch path where torch is importable).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use kindred_node::config::{ExchangeKind, TrainerKind};
use kindred_tests::{NodeProc, TempDir, node_config, python_client, wait_for};

#[test]
fn python_package_tests_pass() {
    let Some(mut python) = python_client() else {
        return;
    };
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../node/python/tests");
    let out = python
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(&tests)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // The torch path is skipped with one line where torch is missing: show it.
    for line in stderr.lines().filter(|l| l.contains("skipped")).take(1) {
        eprintln!("{line}");
    }
}

#[test]
fn python_client_pushes_updates_and_pulls_merged_ones() {
    client_trains_through(ExchangeKind::Hub);
}

/// The pairwise exchange takes the trainer's update by its own round loop.
#[test]
fn python_client_trains_through_a_pairwise_node() {
    client_trains_through(ExchangeKind::Pairwise);
}

/// The package's example trains 3 rounds through a node of `exchange`, which distills and
/// checkpoints each update it pushes.
fn client_trains_through(exchange: ExchangeKind) {
    let Some(mut python) = python_client() else {
        return;
    };
    let dir = TempDir::new("external");
    let mut c = node_config("external-test", 0, 0, 1, 2.0);
    c.trainer.kind = TrainerKind::External;
    c.exchange = exchange;
    let mut node = NodeProc::init(dir.path().join("node"), c);
    node.start();
    wait_for(Duration::from_secs(30), || node.status()).expect("node API up");

    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../node/python/examples/train_mnist.py");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mnist");
    let out = python
        .arg(&script)
        .args([
            "--api",
            &node.api.to_string(),
            "--rounds",
            "3",
            "--timeout",
            "30",
        ])
        .arg("--data")
        .arg(std::env::var_os("KINDRED_DATA").unwrap_or_else(|| data.into_os_string()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed:\n{stdout}\n{}\nnode log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        node.log()
    );
    let last = stdout.lines().last().unwrap();
    let summary: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(summary["rounds"], 3);
    // The node distilled and checkpointed each pushed update.
    let status = node.status().unwrap();
    assert!(status.history.len() >= 3, "{status:?}");
    assert!(
        status
            .history
            .iter()
            .all(|r| r.packet_bytes > 0 && r.accuracy.is_none())
    );
}
