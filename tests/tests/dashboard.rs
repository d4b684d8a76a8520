//! The Grafana dashboard (`node/dashboards/kindred.json`) queries only metrics that real nodes
//! export: two nodes on loopback run a few rounds, and every `kindred_*` name in every panel
//! query and template-variable query must appear as a series in their `/metrics` scrape.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kindred_tests::{NodeProc, TempDir, node_config, wait_for};
use serde_json::Value;

fn dashboard_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../node/dashboards/kindred.json")
}

/// Every `kindred_*` identifier in a PromQL expression: a maximal run of identifier characters
/// (`[a-zA-Z0-9_:]`) that starts with `kindred_`, taken whole (a `_bucket`, `_sum` or `_total`
/// suffix is part of the name, so the exact series must exist).
fn metric_names(expr: &str) -> Vec<String> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find(|c: char| is_ident(c)) {
        let tail = &rest[start..];
        let end = tail.find(|c: char| !is_ident(c)).unwrap_or(tail.len());
        let word = &tail[..end];
        if word.starts_with("kindred_") {
            names.push(word.to_string());
        }
        rest = &tail[end..];
    }
    names
}

/// Series names in an OpenMetrics/Prometheus text scrape: what precedes `{` or a space on each
/// sample line.
fn series_names(scrape: &str) -> BTreeSet<String> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// The value of the unlabelled sample `name` in a scrape.
fn sample(scrape: &str, name: &str) -> Option<f64> {
    scrape.lines().find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok())?
    })
}

/// Every panel, rows' collapsed panels included.
fn all_panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    let mut stack: Vec<&Value> = dashboard["panels"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    while let Some(p) = stack.pop() {
        if let Some(inner) = p["panels"].as_array() {
            stack.extend(inner);
        }
        out.push(p);
    }
    out
}

/// The dashboard's queries: `(where, PromQL)` for every panel target and query variable.
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in all_panels(dashboard) {
        let title = p["title"].as_str().unwrap_or_default();
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push((format!("panel `{title}`"), e.to_string()));
            }
        }
    }
    // Query variables only: a datasource variable's `query` is a plugin id, not PromQL.
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if v["type"] != "query" {
            continue;
        }
        let name = v["name"].as_str().unwrap_or_default();
        for q in [&v["query"], &v["query"]["query"], &v["definition"]] {
            if let Some(q) = q.as_str() {
                out.push((format!("variable `{name}`"), q.to_string()));
            }
        }
    }
    out
}

#[test]
fn extractor_takes_whole_names_only() {
    assert_eq!(
        metric_names(
            r#"histogram_quantile(0.9, sum by (le) (rate(kindred_round_seconds_bucket{instance=~"$instance"}[5m]))) / my_kindred_x + kindred_a:b"#
        ),
        ["kindred_round_seconds_bucket", "kindred_a:b"]
    );
    assert_eq!(
        series_names("# TYPE kindred_x counter\nkindred_x_total 3\nkindred_y{a=\"b\"} 1\n"),
        BTreeSet::from(["kindred_x_total".to_string(), "kindred_y".to_string()])
    );
}

#[test]
fn every_dashboard_metric_is_exported() {
    let text = std::fs::read_to_string(dashboard_path()).unwrap();
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is valid JSON");

    // Shape: Grafana 10+ schema, a Prometheus datasource variable and an instance variable.
    assert!(dashboard["schemaVersion"].as_u64().unwrap() >= 36);
    assert!(dashboard["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert_eq!(dashboard["__inputs"][0]["name"], "DS_PROMETHEUS");
    assert_eq!(dashboard["__inputs"][0]["pluginId"], "prometheus");
    let vars = dashboard["templating"]["list"].as_array().unwrap();
    let var = |name: &str| vars.iter().find(|v| v["name"] == name);
    let ds = var("datasource").expect("a datasource variable");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    let instance = var("instance").expect("an instance variable");
    assert_eq!(instance["type"], "query");
    assert_eq!(instance["datasource"]["uid"], "${datasource}");

    // Every panel has a title; every panel but a row has a query on the templated datasource,
    // filtered by the selected instances.
    let panels = all_panels(&dashboard);
    assert!(!panels.is_empty());
    let mut ids = BTreeSet::new();
    for p in &panels {
        let title = p["title"].as_str().unwrap_or_default();
        assert!(!title.trim().is_empty(), "panel without a title: {p}");
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate id: {p}");
        for k in ["h", "w", "x", "y"] {
            assert!(p["gridPos"][k].is_u64(), "`{title}`: no gridPos.{k}");
        }
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "`{title}`");
        let targets = p["targets"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        assert!(!targets.is_empty(), "panel `{title}` has no target");
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or_default();
            assert!(!expr.trim().is_empty(), "`{title}`: a target without expr");
            assert_eq!(t["datasource"]["uid"], "${datasource}", "`{title}`");
            assert!(
                expr.contains(r#"instance=~"$instance""#),
                "`{title}`: `{expr}` ignores the instance selection"
            );
        }
    }

    let mut used: BTreeSet<String> = BTreeSet::new();
    for (place, q) in queries(&dashboard) {
        let names = metric_names(&q);
        assert!(
            !names.is_empty(),
            "{place}: `{q}` queries no kindred metric"
        );
        used.extend(names);
    }

    // The dashboard covers every area it is for, so the check below cannot pass vacuously.
    let areas: [(&str, &[&str]); 10] = [
        (
            "round",
            &["kindred_round_seconds_bucket", "kindred_rounds_total"],
        ),
        ("accuracy", &["kindred_accuracy"]),
        ("loss", &["kindred_loss"]),
        (
            "role",
            &["kindred_exchange_is_hub", "kindred_exchange_rounds_total"],
        ),
        ("cohort", &["kindred_exchange_cohort"]),
        (
            "bytes",
            &[
                "kindred_rpc_bytes_total",
                "kindred_wire_protocol_bytes_total",
            ],
        ),
        ("reject", &["kindred_rejects_total"]),
        (
            "ban",
            &["kindred_bans_total", "kindred_exchange_bans_total"],
        ),
        ("lookup", &["kindred_lookup_seconds_bucket"]),
        (
            "reachability",
            &["kindred_connected_peers", "kindred_kademlia_server"],
        ),
    ];
    for (area, names) in areas {
        for name in names {
            assert!(
                used.contains(*name),
                "area `{area}`: the dashboard does not query {name}"
            );
        }
    }

    // Two real nodes, the second bootstrapped from the first, run two local rounds each and
    // then search the DHT.
    let started = Instant::now();
    let dir = TempDir::new("dashboard");
    let mut nodes: Vec<NodeProc> = Vec::new();
    for i in 0..2 {
        let mut c = node_config("dashboard-test", 0, i, 2, 2.0);
        if let Some(first) = nodes.first() {
            c.bootstrap = vec![first.bootstrap_addr()];
        }
        nodes.push(NodeProc::init(dir.path().join(format!("node{i}")), c));
    }
    for n in &mut nodes {
        n.start();
    }
    let scrapes: Vec<String> = nodes
        .iter()
        .map(|n| {
            wait_for(Duration::from_secs(40), || {
                n.metrics().filter(|m| {
                    sample(m, "kindred_rounds_total").is_some_and(|r| r >= 2.0)
                        && sample(m, "kindred_connected_peers").is_some_and(|c| c >= 1.0)
                        // A hub-exchange search (after the 2 local rounds) is timed.
                        && sample(m, "kindred_lookup_seconds_count").is_some_and(|c| c >= 1.0)
                        // AutoNAT's verdict (its first probe 5 s after start).
                        && sample(m, "kindred_reachable") == Some(1.0)
                })
            })
            .unwrap_or_else(|| {
                panic!(
                    "no two rounds, a peer connected and a search timed:\n{}\n{}",
                    n.metrics().unwrap_or_default(),
                    n.log()
                )
            })
        })
        .collect();
    eprintln!(
        "nodes ran their rounds and a search in {:?}",
        started.elapsed()
    );

    for scrape in &scrapes {
        let exported = series_names(scrape);
        let missing: Vec<&String> = used.iter().filter(|n| !exported.contains(*n)).collect();
        assert!(
            missing.is_empty(),
            "the dashboard queries metrics the node does not export: {missing:?}\nscrape:\n{scrape}"
        );
        // The reachability gauges take the routing task's state: loopback listen addresses are
        // external for a node, so Kademlia runs as a server, and AutoNAT found it reachable.
        assert_eq!(
            sample(scrape, "kindred_kademlia_server"),
            Some(1.0),
            "{scrape}"
        );
        assert!(
            sample(scrape, "kindred_external_addresses").is_some_and(|n| n >= 1.0),
            "{scrape}"
        );
        assert_eq!(sample(scrape, "kindred_reachable"), Some(1.0), "{scrape}");
    }
    eprintln!(
        "{} metric names, all exported; {:?} in all",
        used.len(),
        started.elapsed()
    );
}
