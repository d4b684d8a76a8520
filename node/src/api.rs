//! The node's local HTTP API (loopback by default): status, Prometheus metrics, and the
//! external-trainer exchange.
//!
//! | route | what |
//! |---|---|
//! | `GET /v1/status` | JSON: peer id, round, loss, accuracy, partners, traffic, history |
//! | `GET /metrics` | Prometheus text exposition |
//! | `GET /v1/spec` | JSON: model id and layers (name, shape, dtype) an update must match |
//! | `POST /v1/update?samples=N&loss=L` | safetensors body: this round's update, one f32 tensor per layer |
//! | `GET /v1/merged?after=R` | safetensors of the newest merged update of a round > R (204 until one exists) |
//!
//! An external trainer (a PyTorch job on the same host, see `examples/external_trainer.py`)
//! pushes its update each round and pulls the merged one; the node does the rest. Request bodies
//! are capped at [`MAX_UPDATE_BYTES`] and validated against the model spec before they reach the
//! round loop, through a bounded channel.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, PoisonError, RwLock};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kindred_proto::ModelSpec;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::engine::ExternalUpdate;
use crate::metrics::NodeMetrics;

/// Largest accepted update body (bytes): 1 GiB, 256M f32 parameters.
pub const MAX_UPDATE_BYTES: usize = 1 << 30;

/// One completed round, as reported by `/v1/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    /// The round.
    pub round: u64,
    /// Local training loss.
    pub loss: f32,
    /// Held-out accuracy after merging (built-in trainer).
    pub accuracy: Option<f32>,
    /// Peers merged.
    pub partners: Vec<String>,
    /// Peers fetched but rejected by the merge, with reasons.
    pub rejected: Vec<(String, String)>,
    /// Bytes of our own packet (header + body).
    pub packet_bytes: u64,
    /// Bytes of the same update in f32 (a full-precision all-reduce share).
    pub f32_bytes: u64,
    /// Lookup wall time, milliseconds.
    pub lookup_ms: u64,
    /// The model snapshot pull of this round, in snapshot rounds with a partner.
    #[serde(default)]
    pub snapshot: Option<SnapshotRecord>,
}

/// What a round's snapshot pull did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// The partner whose snapshot was fetched (or, if none was, the last one asked).
    pub from: String,
    /// `pulled`, `clipped` (pulled, the step cut to its limit), or why not: `not_found`,
    /// `refused`, `invalid`, `stale`, `unusable`, `deadline`, `failed`, `stopped`.
    pub outcome: String,
    /// Norm of the step taken over the norm of the round's merged update (before the pull).
    pub step_ratio: Option<f64>,
    /// Partners asked this round, `from` the last of them: a partner with no usable snapshot is
    /// followed by the next of the better-agreeing half (at most [`crate::run::SNAPSHOT_TRIES`]).
    #[serde(default)]
    pub tries: u32,
}

/// What `/v1/status` returns.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// This node.
    pub peer_id: String,
    /// Listen addresses.
    pub listen: Vec<String>,
    /// Last completed round.
    pub round: Option<u64>,
    /// What this run restored from the store at start-up.
    pub restored: Option<crate::engine::Restored>,
    /// Connected peers.
    pub connected: usize,
    /// Peers banned now.
    pub banned: usize,
    /// Invalid data received, by reason.
    pub rejects: HashMap<String, u64>,
    /// RPC bytes sent to peers since start (headers and bodies served, requests made).
    pub bytes_sent: u64,
    /// RPC bytes received from peers since start.
    pub bytes_received: u64,
    /// Bytes sent over all connections since start, every protocol (Kademlia, identify, ping
    /// and the RPCs).
    #[serde(default)]
    pub wire_bytes_sent: u64,
    /// Bytes received over all connections since start, every protocol.
    #[serde(default)]
    pub wire_bytes_received: u64,
    /// Completed rounds of this run, oldest first (at most the last 1,000).
    pub history: Vec<RoundRecord>,
}

/// Most rounds kept in [`Status::history`].
pub const MAX_HISTORY: usize = 1000;

/// State shared between the round loop and the API.
#[derive(Debug)]
pub struct Shared {
    /// Status, updated by the round loop.
    pub status: RwLock<Status>,
    /// The newest merged update as safetensors, with its round.
    pub merged: RwLock<Option<(u64, Vec<u8>)>>,
    /// Metrics.
    pub metrics: NodeMetrics,
    /// The model spec.
    pub spec: Arc<ModelSpec>,
    /// Updates from an external trainer, to the round loop.
    pub updates: mpsc::Sender<ExternalUpdate>,
}

impl Shared {
    /// Replace the status.
    pub fn set_status(&self, f: impl FnOnce(&mut Status)) {
        f(&mut self.status.write().unwrap_or_else(PoisonError::into_inner));
    }
}

/// Serve the API on `addr` until `shutdown` resolves.
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let app = Router::new()
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/spec", get(spec))
        .route("/v1/update", post(update))
        .route("/v1/merged", get(merged))
        .layer(DefaultBodyLimit::max(MAX_UPDATE_BYTES))
        .with_state(shared);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::warn!(error = %e, "API server stopped");
        }
    });
    Ok(local)
}

async fn status(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    let status = s
        .status
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    axum::Json(status)
}

async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

#[derive(Serialize)]
struct LayerInfo {
    name: String,
    shape: Vec<u32>,
    dtype: String,
}

#[derive(Serialize)]
struct SpecInfo {
    model_id: String,
    params: u64,
    layers: Vec<LayerInfo>,
}

async fn spec(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    axum::Json(SpecInfo {
        model_id: hex::encode(s.spec.id().0),
        params: s.spec.numel(),
        layers: s
            .spec
            .layers()
            .iter()
            .map(|l| LayerInfo {
                name: l.name().to_string(),
                shape: l.shape().to_vec(),
                dtype: format!("{:?}", l.dtype()).to_lowercase(),
            })
            .collect(),
    })
}

#[derive(Deserialize)]
struct UpdateParams {
    samples: u64,
    #[serde(default)]
    loss: f32,
}

async fn update(
    State(s): State<Arc<Shared>>,
    Query(q): Query<UpdateParams>,
    body: Bytes,
) -> Response {
    let update = match update_from_safetensors(&body, &s.spec) {
        Ok(u) => u,
        Err(e) => return (StatusCode::UNPROCESSABLE_ENTITY, e).into_response(),
    };
    if q.samples == 0 || !q.loss.is_finite() {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            "samples must be > 0 and loss finite",
        )
            .into_response();
    }
    match s.updates.try_send(ExternalUpdate {
        update,
        samples: q.samples,
        loss: q.loss,
    }) {
        Ok(()) => StatusCode::ACCEPTED.into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "an update for this round is already queued",
        )
            .into_response(),
    }
}

#[derive(Deserialize)]
struct MergedParams {
    after: Option<u64>,
}

async fn merged(State(s): State<Arc<Shared>>, Query(q): Query<MergedParams>) -> Response {
    let guard = s.merged.read().unwrap_or_else(PoisonError::into_inner);
    match guard.as_ref() {
        Some((round, bytes)) if q.after.is_none_or(|a| *round > a) => (
            [
                (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                (
                    header::HeaderName::from_static("x-kindred-round"),
                    round.to_string(),
                ),
            ],
            bytes.clone(),
        )
            .into_response(),
        _ => StatusCode::NO_CONTENT.into_response(),
    }
}

/// Read an update from safetensors: exactly one f32 tensor per spec layer, same names and shapes,
/// all values finite. Returns the update flat in spec order.
///
/// # Errors
/// A message naming the first mismatch.
pub fn update_from_safetensors(bytes: &[u8], spec: &ModelSpec) -> Result<Vec<f32>, String> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors file: {e}"))?;
    if st.len() != spec.layers().len() {
        return Err(format!(
            "{} tensors, the model has {} layers",
            st.len(),
            spec.layers().len()
        ));
    }
    let mut out = Vec::with_capacity(spec.numel() as usize);
    for layer in spec.layers() {
        let t = st
            .tensor(layer.name())
            .map_err(|_| format!("tensor `{}` is missing", layer.name()))?;
        let shape: Vec<usize> = layer.shape().iter().map(|&d| d as usize).collect();
        if t.dtype() != Dtype::F32 || t.shape() != shape.as_slice() {
            return Err(format!(
                "tensor `{}` is {:?} {:?}, expected F32 {:?}",
                layer.name(),
                t.dtype(),
                t.shape(),
                shape
            ));
        }
        let start = out.len();
        out.extend(
            t.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        if out[start..].iter().any(|v| !v.is_finite()) {
            return Err(format!("tensor `{}` holds NaN or infinity", layer.name()));
        }
    }
    Ok(out)
}

/// Write a flat update as safetensors, one f32 tensor per spec layer.
///
/// # Errors
/// When `update` does not have the spec's length.
pub fn update_to_safetensors(update: &[f32], spec: &ModelSpec) -> Result<Vec<u8>, String> {
    if update.len() as u64 != spec.numel() {
        return Err(format!(
            "update has {} values, the model {}",
            update.len(),
            spec.numel()
        ));
    }
    let bytes: Vec<u8> = update.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut views = Vec::with_capacity(spec.layers().len());
    let mut offset = 0;
    for layer in spec.layers() {
        let n = layer.numel() as usize * 4;
        let shape = layer.shape().iter().map(|&d| d as usize).collect();
        let data = bytes.get(offset..offset + n).ok_or("update too short")?;
        views.push((
            layer.name().to_string(),
            TensorView::new(Dtype::F32, shape, data).map_err(|e| e.to_string())?,
        ));
        offset += n;
    }
    safetensors::serialize(views, None).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::Arch;

    #[test]
    fn safetensors_round_trip_and_validation() {
        let spec = Arch::MLP.spec().unwrap();
        let update: Vec<f32> = (0..spec.numel()).map(|i| i as f32 * 1e-6).collect();
        let bytes = update_to_safetensors(&update, &spec).unwrap();
        assert_eq!(update_from_safetensors(&bytes, &spec).unwrap(), update);
        assert!(update_from_safetensors(&bytes[..100], &spec).is_err());
        assert!(update_from_safetensors(b"garbage", &spec).is_err());
        let other = Arch::Mlp { hidden: 32 }.spec().unwrap();
        assert!(
            update_from_safetensors(&bytes, &other)
                .unwrap_err()
                .contains("fc1.weight")
        );
        let mut nan = update;
        nan[5] = f32::NAN;
        let bytes = update_to_safetensors(&nan, &spec).unwrap();
        assert!(
            update_from_safetensors(&bytes, &spec)
                .unwrap_err()
                .contains("NaN")
        );
    }
}
