//! The node's local HTTP API (loopback by default): status, Prometheus metrics, and the
//! external-trainer exchange.
//!
//! | route | what |
//! |---|---|
//! | `GET /v1/status` | JSON: peer id, round, loss, accuracy, partners, traffic, history |
//! | `GET /metrics` | Prometheus text exposition |
//! | `GET /v1/spec` | JSON: model id and layers (name, shape, dtype) an update must match |
//! | `POST /v1/update?samples=N&loss=L` | safetensors body: this round's update, one f32 tensor per layer; 202 when queued |
//! | `GET /v1/merged?after=R` | safetensors of the newest merged update of a round > R (204 until one exists; the hub exchange releases it when the next update arrives) |
//!
//! An external trainer (a PyTorch job on the same host, through the `kindred` Python package in
//! `node/python`) pushes its update each round and pulls the merged one; the node does the rest.
//!
//! # Limits
//!
//! The API is meant for a trusted job on the same host, but anything that can reach the port can
//! talk to it, so every request is bounded in time and memory, and nothing reaches the round loop
//! (or the node's own signed packet) unvalidated:
//!
//! - **Timeouts** ([`ApiLimits`]): a client has `header_timeout_secs` (default 10 s) to send a
//!   complete request header; the same timer closes idle keep-alive connections. An update body
//!   must arrive within `body_timeout_secs` (default 10 s) plus the body cap divided by
//!   `min_body_rate` (default 8 MiB/s), or the upload is answered 408 and dropped.
//! - **Size**: an update body may be at most [`update_body_cap`] bytes: the exact tensor data the
//!   model spec implies (4 bytes per parameter) plus a small allowance for the safetensors header,
//!   and never more than [`MAX_UPDATE_BYTES`]. A larger declared `Content-Length` is answered 413
//!   at once, without reading the body; a chunked body is cut off (413) as soon as it passes the
//!   cap.
//! - **Concurrency**: one update upload at a time ([`MAX_CONCURRENT_UPLOADS`]); a second one is
//!   answered 409, and an upload while this round's update is already queued is answered 503,
//!   both before their bodies are read. The body is decoded as it arrives
//!   ([`crate::update_stream`]), never buffered, and its checked values are written to a staging
//!   file in the node's store (`store/staging/`, [`crate::staged`]; removed once distilled or
//!   refused): the memory an upload holds is its header and a few body frames, whatever the
//!   model's size or the number of clients. 500 when the file cannot be written.
//! - **Values**: `samples` must be in `1..=`[`kindred_proto::MAX_SAMPLES`], `loss` finite with
//!   magnitude at most [`kindred_proto::MAX_ABS_LOSS`], and every tensor value finite with
//!   magnitude at most [`MAX_ABS_UPDATE_VALUE`]; otherwise 422 with a message naming the
//!   problem (400 when the query does not parse). These are the bounds the packet codec enforces
//!   on what peers send, so a bad upload is refused here instead of costing a round.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::pin;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, HttpBody};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use kindred_proto::{MAX_ABS_LOSS, MAX_SAMPLES, ModelSpec};
use safetensors::{Dtype, tensor::TensorView};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, watch};

use crate::engine::{ExternalUpdate, UpdateValues};
use crate::merged::{self, MergedUpdate};
use crate::metrics::NodeMetrics;
use crate::staged::{StagedUpdate, StagedWriter};
use crate::update_stream::{UpdateDecoder, UpdateError};

/// Largest accepted update body (bytes), whatever the model: 16 GiB, 2^32 f32 parameters (on a
/// 64-bit host). [`update_body_cap`] is the exact cap for a given model, and the body is decoded
/// as it arrives, so an upload never holds more than the model's update.
pub const MAX_UPDATE_BYTES: usize = if (usize::MAX as u64) < (16 << 30) {
    usize::MAX
} else {
    (16u64 << 30) as usize
};

/// Room for the safetensors header in [`update_body_cap`], besides the per-layer allowance:
/// the 8-byte length prefix, the JSON braces, a `__metadata__` map (PyTorch writers add
/// `{"format": "pt"}`) and alignment padding.
pub const UPDATE_HEADER_ALLOWANCE: usize = 64 << 10;

/// Header bytes allowed per layer in [`update_body_cap`], besides 6 bytes per byte of the layer
/// name (the worst case of JSON escaping): dtype, shape (at most 8 dimensions of 20 digits)
/// and the two data offsets.
pub const UPDATE_HEADER_PER_LAYER: usize = 512;

/// Largest magnitude of a value in an uploaded update.
///
/// An update is a change of the model's parameters over one round; trained weights are of order
/// one, so a change anywhere near this bound is a bug or an attack, not a training signal. The
/// bound also keeps everything the merge computes finite in f32: a layer of the largest size
/// ([`kindred_proto::MAX_LAYER_ELEMS`], 2^32 − 1) at this magnitude has a squared norm of about
/// 4.3e21, far below `f32::MAX` (3.4e38), while a single 3e38 would overflow every norm and
/// every weighted sum it enters.
pub const MAX_ABS_UPDATE_VALUE: f32 = 1.0e6;

/// Update uploads served at the same time; others are refused (409) before their bodies are read.
pub const MAX_CONCURRENT_UPLOADS: usize = 1;

/// Body frames of an upload queued for its decoding thread (a frame is at most a few hundred
/// KiB): enough to keep the decoder busy, few enough to bound what an upload holds.
const UPLOAD_FRAMES_QUEUED: usize = 16;

/// Timeouts of the API server (the `[api_limits]` table of `kindred.toml`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiLimits {
    /// Seconds a client has to send a complete request header, counted from when the server
    /// starts waiting for it (so it also closes idle keep-alive connections). Default 10.
    pub header_timeout_secs: f64,
    /// Seconds an update body may take to arrive, besides the time `min_body_rate` allows for
    /// the body cap. Default 10.
    pub body_timeout_secs: f64,
    /// Slowest upload rate allowed for, bytes per second: the body deadline is
    /// `body_timeout_secs + cap / min_body_rate`. Default 8 MiB/s (a 1 GiB cap gets 138 s, the
    /// built-in MLP's 0.3 MB about 10 s).
    pub min_body_rate: u64,
}

impl Default for ApiLimits {
    fn default() -> Self {
        Self {
            header_timeout_secs: 10.0,
            body_timeout_secs: 10.0,
            min_body_rate: 8 << 20,
        }
    }
}

impl ApiLimits {
    /// Check ranges: both timeouts positive and finite (at most a day), the rate at least 1.
    ///
    /// # Errors
    /// A message naming the first bad value.
    pub fn validate(&self) -> Result<(), String> {
        let ok = |s: f64| s.is_finite() && s > 0.0 && s <= 86_400.0;
        if !ok(self.header_timeout_secs) {
            return Err("api_limits.header_timeout_secs must be in (0, 86400]".into());
        }
        if !ok(self.body_timeout_secs) {
            return Err("api_limits.body_timeout_secs must be in (0, 86400]".into());
        }
        if self.min_body_rate == 0 {
            return Err("api_limits.min_body_rate must be at least 1".into());
        }
        Ok(())
    }

    /// The header read timeout (the default when the configured value is not a valid duration).
    pub fn header_timeout(&self) -> Duration {
        secs_or(
            self.header_timeout_secs,
            Self::default().header_timeout_secs,
        )
    }

    /// The deadline for an update body of at most `cap` bytes.
    pub fn body_timeout(&self, cap: usize) -> Duration {
        let base = secs_or(self.body_timeout_secs, Self::default().body_timeout_secs);
        let rate = self.min_body_rate.max(1) as f64;
        base.saturating_add(secs_or(cap as f64 / rate, 0.0))
    }
}

/// `secs` as a duration, or `fallback` when it is not one (negative, NaN, too large).
fn secs_or(secs: f64, fallback: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or_else(|_| Duration::from_secs_f64(fallback))
}

/// Largest update body accepted for `spec` (bytes): the f32 tensor data (exact), plus
/// [`UPDATE_HEADER_PER_LAYER`] and six bytes per byte of name for each layer, plus
/// [`UPDATE_HEADER_ALLOWANCE`]; at most [`MAX_UPDATE_BYTES`].
pub fn update_body_cap(spec: &ModelSpec) -> usize {
    let header = spec
        .layers()
        .iter()
        .fold(UPDATE_HEADER_ALLOWANCE as u64, |acc, l| {
            acc.saturating_add(6 * l.name().len() as u64 + UPDATE_HEADER_PER_LAYER as u64)
        });
    let cap = spec.numel().saturating_mul(4).saturating_add(header);
    usize::try_from(cap).map_or(MAX_UPDATE_BYTES, |c| c.min(MAX_UPDATE_BYTES))
}

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
    /// What the hub exchange did this round (`None` with the pairwise exchange).
    #[serde(default)]
    pub exchange: Option<crate::exchange::HubRoundStats>,
    /// Bytes the node had sent over all its connections (every protocol) by the round's end,
    /// since it started.
    #[serde(default)]
    pub wire_bytes_sent: u64,
    /// The same bytes by protocol (`kademlia`, `rpc`, `identify`, `ping`, `autonat`, `other`).
    #[serde(default)]
    pub wire_sent_by_protocol: BTreeMap<String, u64>,
    /// Where the round's time went.
    #[serde(default)]
    pub timings: RoundTimings,
}

/// Where one round's time went, seconds (what `kindred bench-model` reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundTimings {
    /// Training (built-in trainer), distilling, embedding, sealing and storing the node's
    /// packet: wall time.
    pub packet_seconds: f64,
    /// The distiller's step within it (compression with error feedback): wall time.
    pub distill_seconds: f64,
    /// CPU time of the node process over the distiller's step, all threads (`None` where the
    /// platform does not say): elements ÷ this is the distiller's rate per core.
    pub distill_cpu_seconds: Option<f64>,
    /// The exchange: lookups, pushes, merges and applying the result.
    pub exchange_seconds: f64,
    /// Sealing the model snapshot, publishing the merge to the trainer, persisting the
    /// exchange and the checkpoint.
    pub checkpoint_seconds: f64,
    /// From the round's start (its update in hand) to its end.
    pub round_seconds: f64,
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
    /// Whether other peers can dial this node (AutoNAT dial-back tests): `public`, `private` or
    /// `unknown`.
    #[serde(default)]
    pub reachability: kindred_routing::reachability::NatStatus,
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
    /// Bytes sent since start by protocol (`kademlia`, `rpc`, `identify`, `ping`, `autonat`, `other`).
    #[serde(default)]
    pub wire_sent_by_protocol: BTreeMap<String, u64>,
    /// Bytes received since start by protocol.
    #[serde(default)]
    pub wire_received_by_protocol: BTreeMap<String, u64>,
    /// Relays this node holds a reservation with (it is behind NAT: peers reach it through
    /// them to punch a hole).
    #[serde(default)]
    pub relays: Vec<String>,
    /// Peers with a direct connection open now (not through a relay), with the RPC bytes
    /// exchanged with each since start (packets and the hub exchange run on direct connections
    /// only).
    #[serde(default)]
    pub direct_peers: BTreeMap<String, u64>,
    /// Connections through relays open now.
    #[serde(default)]
    pub relayed_connections: u64,
    /// RPC bytes (both directions) that crossed a relayed connection since start: 0, as
    /// packets and the hub exchange wait for a direct connection.
    #[serde(default)]
    pub relayed_rpc_bytes: u64,
    /// Hole punches that opened a direct connection since start.
    #[serde(default)]
    pub hole_punches: u64,
    /// Relay reservations granted to this node since start (renewals not counted).
    #[serde(default)]
    pub relay_reservations: u64,
    /// This node and every peer of its cohort are behind NAT: its hub is one of them, reached
    /// only where a hole punch succeeds (a node with a forwarded port would head the cohort).
    #[serde(default)]
    pub no_dialable_peer: bool,
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
    /// The update the newest round applied, with its round; served as safetensors.
    pub merged: RwLock<Option<(u64, Arc<MergedUpdate>)>>,
    /// Metrics.
    pub metrics: NodeMetrics,
    /// The model spec.
    pub spec: Arc<ModelSpec>,
    /// Updates from an external trainer, to the round loop.
    pub updates: mpsc::Sender<ExternalUpdate>,
    /// Where uploaded updates are staged ([`StagedUpdate`]): a directory of the node's own.
    pub staging: PathBuf,
}

impl Shared {
    /// Replace the status.
    pub fn set_status(&self, f: impl FnOnce(&mut Status)) {
        f(&mut self.status.write().unwrap_or_else(PoisonError::into_inner));
    }
}

/// The API's state: the node's shared state and the upload limits.
#[derive(Debug)]
struct Api {
    shared: Arc<Shared>,
    /// [`update_body_cap`] of the model.
    cap: usize,
    /// Deadline for one update body.
    body_timeout: Duration,
    /// Permits for update uploads in flight ([`MAX_CONCURRENT_UPLOADS`]).
    uploads: Arc<Semaphore>,
}

impl Api {
    fn new(shared: Arc<Shared>, limits: &ApiLimits) -> Self {
        let cap = update_body_cap(&shared.spec);
        Self {
            shared,
            cap,
            body_timeout: limits.body_timeout(cap),
            uploads: Arc::new(Semaphore::new(MAX_CONCURRENT_UPLOADS)),
        }
    }
}

fn router(api: Arc<Api>) -> Router {
    Router::new()
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/spec", get(spec))
        .route("/v1/update", post(update))
        .route("/v1/merged", get(merged))
        .with_state(api)
}

/// Serve the API on `addr` until `shutdown` resolves, within `limits`.
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    shared: Arc<Shared>,
    limits: ApiLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = router(Arc::new(Api::new(shared, &limits)));
    tokio::spawn(accept_loop(
        listener,
        app,
        limits.header_timeout(),
        shutdown,
    ));
    Ok(local)
}

/// Accept connections until `shutdown`, serving each with HTTP/1.1 and a header read timeout;
/// at shutdown, connections finish the request in progress and close.
async fn accept_loop(
    listener: TcpListener,
    app: Router,
    header_timeout: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors, most likely: back off instead of spinning.
                    tracing::warn!(%error, "API: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), service));
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            let result = tokio::select! {
                r = conn.as_mut() => r,
                () = stopped => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(error) = result {
                tracing::debug!(%error, "API connection closed");
            }
        });
    }
    let _ = stop_tx.send(true);
}

async fn status(State(api): State<Arc<Api>>) -> impl IntoResponse {
    let status = api
        .shared
        .status
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    axum::Json(status)
}

async fn metrics(State(api): State<Arc<Api>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        api.shared.metrics.render(),
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

async fn spec(State(api): State<Arc<Api>>) -> impl IntoResponse {
    let s = &api.shared;
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

impl UpdateParams {
    /// The bounds the packet codec puts on the same fields of our own packet.
    fn check(&self) -> Result<(), String> {
        if !(1..=MAX_SAMPLES).contains(&self.samples) {
            return Err(format!(
                "samples must be in 1..={MAX_SAMPLES}, got {}",
                self.samples
            ));
        }
        if !(self.loss.is_finite() && self.loss.abs() <= MAX_ABS_LOSS) {
            return Err(format!(
                "loss must be finite with magnitude at most {MAX_ABS_LOSS:e}, got {}",
                self.loss
            ));
        }
        Ok(())
    }
}

/// A refusal: the status and a one-line text body.
fn refuse(code: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    tracing::debug!(%code, %message, "API: update refused");
    (code, message).into_response()
}

/// Why an update body could not be read.
#[derive(Debug, thiserror::Error)]
enum BodyError {
    #[error("the update body is over the limit of {0} bytes for this model")]
    TooLarge(usize),
    #[error("reading the update body: {0}")]
    Read(axum::Error),
    #[error(transparent)]
    Invalid(UpdateError),
}

/// Read `body` into the node's staging file as it arrives ([`UpdateDecoder`] into a
/// [`StagedUpdate`]: no copy of the update in memory), failing as soon as it passes `cap`
/// bytes. Decoding and the file's writes run on a blocking thread, fed the body's frames
/// through a short queue. A body found invalid is still read to its end (within `cap` and the
/// caller's deadline) without being kept, so the client gets the answer rather than a reset
/// connection. On any failure the staging file is removed with the update.
async fn read_update(
    mut body: Body,
    cap: usize,
    spec: Arc<ModelSpec>,
    staging: PathBuf,
) -> Result<StagedUpdate, BodyError> {
    let (frames, mut queue) = mpsc::channel::<axum::body::Bytes>(UPLOAD_FRAMES_QUEUED);
    let decode = tokio::task::spawn_blocking(move || {
        let len = usize::try_from(spec.numel()).unwrap_or(usize::MAX);
        let staged = StagedUpdate::create(&staging, len)
            .map_err(|e| UpdateError::Store(format!("{}: {e}", staging.display())))?;
        let writer = StagedWriter::new(staged);
        let mut decoder = UpdateDecoder::with_sink(&spec, update_header_cap(&spec), writer);
        let mut invalid = None;
        while let Some(data) = queue.blocking_recv() {
            if invalid.is_none()
                && let Err(e) = decoder.feed(&data)
            {
                invalid = Some(e);
            }
        }
        match invalid {
            Some(e) => Err(e),
            None => decoder
                .finish()?
                .finish()
                .map_err(|e| UpdateError::Store(e.to_string())),
        }
    });
    let mut read = 0usize;
    while let Some(frame) =
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
    {
        let Ok(data) = frame.map_err(BodyError::Read)?.into_data() else {
            continue; // trailers
        };
        if data.len() > cap.saturating_sub(read) {
            return Err(BodyError::TooLarge(cap));
        }
        read += data.len();
        // The decoder stops taking frames only once it returned: then it failed to start.
        if frames.send(data).await.is_err() {
            break;
        }
    }
    drop(frames);
    match decode.await {
        Ok(decoded) => decoded.map_err(BodyError::Invalid),
        Err(e) => Err(BodyError::Invalid(UpdateError::Store(e.to_string()))),
    }
}

/// `POST /v1/update`: every check that needs no body first (query, declared size, upload permit,
/// queue slot), then the body within its deadline, then the tensors.
async fn update(
    State(api): State<Arc<Api>>,
    Query(q): Query<UpdateParams>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if let Err(e) = q.check() {
        return refuse(StatusCode::UNPROCESSABLE_ENTITY, e);
    }
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared
        && n > api.cap as u64
    {
        return refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "an update of {n} bytes is over the limit of {} bytes for this model",
                api.cap
            ),
        );
    }
    let Ok(_permit) = api.uploads.clone().try_acquire_owned() else {
        return refuse(StatusCode::CONFLICT, "another update upload is in progress");
    };
    // The queue slot is held from here, so an accepted body always has somewhere to go.
    let slot = match api.shared.updates.clone().try_reserve_owned() {
        Ok(slot) => slot,
        Err(mpsc::error::TrySendError::Full(_)) => {
            return refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "an update for this round is already queued",
            );
        }
        Err(mpsc::error::TrySendError::Closed(_)) => {
            return refuse(StatusCode::SERVICE_UNAVAILABLE, "the node is shutting down");
        }
    };
    let (spec, staging) = (api.shared.spec.clone(), api.shared.staging.clone());
    let update =
        match tokio::time::timeout(api.body_timeout, read_update(body, api.cap, spec, staging))
            .await
        {
            Ok(Ok(update)) => update,
            Ok(Err(e @ BodyError::TooLarge(_))) => {
                return refuse(StatusCode::PAYLOAD_TOO_LARGE, e.to_string());
            }
            Ok(Err(e @ BodyError::Read(_))) => {
                return refuse(StatusCode::BAD_REQUEST, e.to_string());
            }
            Ok(Err(BodyError::Invalid(e @ UpdateError::Store(_)))) => {
                tracing::warn!(error = %e, "API: cannot stage an update");
                return refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
            }
            Ok(Err(BodyError::Invalid(e))) => {
                return refuse(StatusCode::UNPROCESSABLE_ENTITY, e.to_string());
            }
            Err(_) => {
                return refuse(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the update body did not arrive within {:.1} s",
                        api.body_timeout.as_secs_f64()
                    ),
                );
            }
        };
    slot.send(ExternalUpdate {
        update: UpdateValues::Staged(update),
        samples: q.samples,
        loss: q.loss,
    });
    StatusCode::ACCEPTED.into_response()
}

#[derive(Deserialize)]
struct MergedParams {
    after: Option<u64>,
}

async fn merged(State(api): State<Arc<Api>>, Query(q): Query<MergedParams>) -> Response {
    let newest = api
        .shared
        .merged
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let Some((round, update)) = newest.filter(|(r, _)| q.after.is_none_or(|a| *r > a)) else {
        return StatusCode::NO_CONTENT.into_response();
    };
    let spec = &api.shared.spec;
    // Written chunk by chunk as the trainer reads: the file is never whole in memory.
    let sized = merged::safetensors_len(&update, spec)
        .and_then(|len| Ok((len, merged::safetensors_chunks(update, spec)?)));
    match sized {
        Ok((len, chunks)) => (
            [
                (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                (header::CONTENT_LENGTH, len.to_string()),
                (
                    header::HeaderName::from_static("x-kindred-round"),
                    round.to_string(),
                ),
            ],
            Body::from_stream(futures::stream::unfold(chunks, |mut chunks| async move {
                // A chunk is 4 MiB formed in memory or read from a staging file: on the
                // blocking pool, never on the runtime's threads.
                let (chunk, chunks) = tokio::task::spawn_blocking(move || (chunks.next(), chunks))
                    .await
                    .ok()?;
                if let Some(Err(e)) = &chunk {
                    tracing::error!(error = %e, "cannot read the merged update");
                }
                Some((chunk?, chunks))
            })),
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "cannot serve the merged update");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

/// Read an update from safetensors: exactly one f32 tensor per spec layer, same names and shapes,
/// all values finite with magnitude at most [`MAX_ABS_UPDATE_VALUE`]. Returns the update flat in
/// spec order. The API decodes uploads the same way as they arrive
/// ([`crate::update_stream::UpdateDecoder`]); this is that decoder fed one whole file.
///
/// # Errors
/// [`UpdateError`] naming the first mismatch.
pub fn update_from_safetensors(bytes: &[u8], spec: &ModelSpec) -> Result<Vec<f32>, UpdateError> {
    let mut decoder = UpdateDecoder::new(spec, update_header_cap(spec));
    decoder.feed(bytes)?;
    decoder.finish()
}

/// Most header bytes of an update for `spec`: [`update_body_cap`] less the tensor data and the
/// 8-byte length.
pub fn update_header_cap(spec: &ModelSpec) -> usize {
    let data = usize::try_from(spec.numel().saturating_mul(4)).unwrap_or(usize::MAX);
    update_body_cap(spec).saturating_sub(data).saturating_sub(8)
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
    // The update's own memory (little-endian targets): no model-sized copy besides the file.
    let bytes = kindred_distill::f32_le_bytes(update);
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
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Longest any test waits for the server.
    const PATIENCE: Duration = Duration::from_secs(5);

    /// A server for the MLP spec on a loopback port, with `limits`; the receiving end of its
    /// update queue.
    async fn start(limits: ApiLimits) -> (SocketAddr, Arc<Api>, mpsc::Receiver<ExternalUpdate>) {
        let (tx, rx) = mpsc::channel(1);
        let shared = Arc::new(Shared {
            status: Default::default(),
            merged: Default::default(),
            metrics: NodeMetrics::new(),
            spec: Arc::new(Arch::MLP.spec().unwrap()),
            updates: tx,
            staging: std::env::temp_dir().join(format!("kindred-api-{}", rand::random::<u64>())),
        });
        let api = Arc::new(Api::new(shared, &limits));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(accept_loop(
            listener,
            router(api.clone()),
            limits.header_timeout(),
            std::future::pending(),
        ));
        (addr, api, rx)
    }

    /// A valid MLP update with `value` at one position, as safetensors.
    fn body_with(value: f32) -> Vec<u8> {
        let spec = Arch::MLP.spec().unwrap();
        let mut update = vec![1e-3f32; spec.numel() as usize];
        update[7] = value;
        update_to_safetensors(&update, &spec).unwrap()
    }

    fn update_head(query: &str, len: u64, expect_continue: bool) -> String {
        let expect = if expect_continue {
            "Expect: 100-continue\r\n"
        } else {
            ""
        };
        format!(
            "POST /v1/update?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len}\r\n\
             {expect}Connection: close\r\n\r\n"
        )
    }

    /// Reads until the end of a response head (or the connection's end).
    async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) {
        let mut chunk = [0u8; 4096];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            match tokio::time::timeout(PATIENCE, s.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
                Err(_) => panic!("no response within {PATIENCE:?}"),
            }
        }
    }

    /// Reads the rest of the response until the server closes; its status and text.
    async fn finish(mut s: TcpStream, mut buf: Vec<u8>) -> (u16, String) {
        let _ = tokio::time::timeout(PATIENCE, s.read_to_end(&mut buf))
            .await
            .expect("the server did not close the connection");
        let text = String::from_utf8_lossy(&buf).to_string();
        let code = text
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
        (code, text)
    }

    /// POSTs an update with `Expect: 100-continue`: the body is only sent when the server asks
    /// for it, so a refusal never races the upload.
    async fn post(addr: SocketAddr, query: &str, body: &[u8]) -> (u16, String) {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let head = update_head(query, body.len() as u64, true);
        s.write_all(head.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        read_head(&mut s, &mut buf).await;
        if buf.starts_with(b"HTTP/1.1 100") {
            buf.clear();
            s.write_all(body).await.unwrap();
        }
        finish(s, buf).await
    }

    #[tokio::test]
    async fn half_a_header_is_dropped_at_the_header_timeout() {
        let limits = ApiLimits {
            header_timeout_secs: 0.3,
            ..ApiLimits::default()
        };
        let (addr, _api, _rx) = start(limits).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /v1/update HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let began = Instant::now();
        let mut buf = [0u8; 1024];
        let closed = tokio::time::timeout(Duration::from_secs(3), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(
            closed.is_ok(),
            "a half-sent header kept the connection for 3 s"
        );
        assert!(
            began.elapsed() >= Duration::from_millis(100),
            "closed before the timeout: {:?}",
            began.elapsed()
        );
    }

    #[tokio::test]
    async fn a_declared_oversize_body_gets_413_without_being_read() {
        let (addr, api, mut rx) = start(ApiLimits::default()).await;
        assert!(api.cap < 1 << 20, "the MLP's cap is its size: {}", api.cap);
        let began = Instant::now();
        let mut s = TcpStream::connect(addr).await.unwrap();
        let head = update_head("samples=10", 10 << 30, false);
        s.write_all(head.as_bytes()).await.unwrap();
        let (code, text) = finish(s, Vec::new()).await;
        assert_eq!(code, 413, "{text}");
        assert!(
            began.elapsed() < Duration::from_secs(2),
            "{:?}",
            began.elapsed()
        );
        // One byte over the cap is too much as well; the cap itself is fine.
        let mut s = TcpStream::connect(addr).await.unwrap();
        let head = update_head("samples=10", api.cap as u64 + 1, false);
        s.write_all(head.as_bytes()).await.unwrap();
        assert_eq!(finish(s, Vec::new()).await.0, 413);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_body_slower_than_its_deadline_gets_408() {
        let limits = ApiLimits {
            body_timeout_secs: 0.3,
            min_body_rate: u64::MAX,
            ..ApiLimits::default()
        };
        let (addr, _api, mut rx) = start(limits).await;
        let body = body_with(0.5);
        let mut s = TcpStream::connect(addr).await.unwrap();
        let head = update_head("samples=10", body.len() as u64, false);
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&body[..body.len() / 2]).await.unwrap();
        let (code, text) = finish(s, Vec::new()).await;
        assert_eq!(code, 408, "{text}");
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn one_upload_at_a_time_and_none_while_one_is_queued() {
        let (addr, api, mut rx) = start(ApiLimits::default()).await;
        let body = body_with(0.5);
        // A first upload sends its header and half its body, and stalls.
        let mut first = TcpStream::connect(addr).await.unwrap();
        let head = update_head("samples=10&loss=0.5", body.len() as u64, false);
        first.write_all(head.as_bytes()).await.unwrap();
        let half = body.len() / 2;
        first.write_all(&body[..half]).await.unwrap();
        let began = Instant::now();
        while api.uploads.available_permits() > 0 {
            assert!(began.elapsed() < PATIENCE, "the first upload never started");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A second one is refused before its body is asked for.
        let (code, text) = post(addr, "samples=20", &body).await;
        assert_eq!(code, 409, "{text}");
        // The first one completes and is queued.
        first.write_all(&body[half..]).await.unwrap();
        let (code, text) = finish(first, Vec::new()).await;
        assert_eq!(code, 202, "{text}");
        // With its update queued, the next upload is refused at once, its body never sent.
        let mut third = TcpStream::connect(addr).await.unwrap();
        let head = update_head("samples=30", body.len() as u64, false);
        third.write_all(head.as_bytes()).await.unwrap();
        let (code, text) = finish(third, Vec::new()).await;
        assert_eq!(code, 503, "{text}");
        let queued = rx.try_recv().unwrap();
        assert_eq!((queued.samples, queued.loss), (10, 0.5));
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn huge_and_non_finite_values_get_422() {
        let (addr, api, mut rx) = start(ApiLimits::default()).await;
        let staged_files = || std::fs::read_dir(&api.shared.staging).unwrap().count();
        for bad in [3e38, -3e38, 1.5e6, f32::NAN, f32::INFINITY] {
            let (code, text) = post(addr, "samples=10", &body_with(bad)).await;
            assert_eq!(code, 422, "{bad}: {text}");
            assert!(rx.try_recv().is_err(), "{bad} was queued");
            assert_eq!(
                staged_files(),
                0,
                "a refused update's staging file is removed"
            );
        }
        let (code, text) = post(addr, "samples=10", &body_with(-MAX_ABS_UPDATE_VALUE)).await;
        assert_eq!(code, 202, "{text}");
        let UpdateValues::Staged(staged) = rx.try_recv().unwrap().update else {
            panic!("the API stages every update");
        };
        assert_eq!(staged.to_vec().unwrap()[7], -MAX_ABS_UPDATE_VALUE);
        assert_eq!(staged_files(), 1);
        drop(staged);
        assert_eq!(staged_files(), 0, "the file goes with the update");
        std::fs::remove_dir(&api.shared.staging).unwrap();
    }

    #[tokio::test]
    async fn samples_and_loss_out_of_range_are_refused() {
        let (addr, _api, mut rx) = start(ApiLimits::default()).await;
        let body = body_with(0.5);
        for (query, want) in [
            ("samples=18446744073709551615", 422),
            ("samples=0", 422),
            ("samples=4294967297", 422),
            ("samples=10&loss=1e7", 422),
            ("samples=10&loss=-inf", 422),
            ("samples=10&loss=NaN", 422),
            ("samples=18446744073709551616", 400),
            ("samples=-1", 400),
            ("samples=ten", 400),
            ("loss=0.5", 400),
        ] {
            let (code, text) = post(addr, query, &body).await;
            assert_eq!(code, want, "{query}: {text}");
            assert!(rx.try_recv().is_err(), "{query} was queued");
        }
        let (code, text) = post(addr, "samples=4294967296&loss=-1e6", &body).await;
        assert_eq!(code, 202, "{text}");
        let queued = rx.try_recv().unwrap();
        assert_eq!((queued.samples, queued.loss), (MAX_SAMPLES, -MAX_ABS_LOSS));
    }

    #[test]
    fn the_body_cap_fits_real_updates_and_little_more() {
        for arch in [Arch::MLP, Arch::Mlp { hidden: 32 }] {
            let spec = arch.spec().unwrap();
            let bytes = update_to_safetensors(&vec![0.0; spec.numel() as usize], &spec).unwrap();
            let cap = update_body_cap(&spec);
            assert!(bytes.len() <= cap, "{} > {cap}", bytes.len());
            let slack = UPDATE_HEADER_ALLOWANCE + 8 * UPDATE_HEADER_PER_LAYER;
            assert!(cap - bytes.len() <= slack, "{cap} vs {}", bytes.len());
        }
        let limits = ApiLimits::default();
        assert_eq!(limits.header_timeout(), Duration::from_secs(10));
        assert_eq!(limits.body_timeout(8 << 20), Duration::from_secs(11));
        assert_eq!(limits.body_timeout(1 << 30), Duration::from_secs(138));
        let broken = ApiLimits {
            header_timeout_secs: f64::NAN,
            body_timeout_secs: -1.0,
            min_body_rate: 0,
        };
        assert!(broken.validate().is_err());
        assert_eq!(broken.header_timeout(), Duration::from_secs(10));
        assert!(broken.body_timeout(1 << 20) < Duration::from_secs(1 << 21));
        limits.validate().unwrap();
    }

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
                .to_string()
                .contains("fc1.weight")
        );
        let mut big = update.clone();
        big[5] = MAX_ABS_UPDATE_VALUE;
        let bytes = update_to_safetensors(&big, &spec).unwrap();
        assert_eq!(update_from_safetensors(&bytes, &spec).unwrap(), big);
        big[5] = 1.000_001e6;
        let bytes = update_to_safetensors(&big, &spec).unwrap();
        assert!(matches!(
            update_from_safetensors(&bytes, &spec),
            Err(UpdateError::OutOfBounds { .. })
        ));
        let mut nan = update;
        nan[5] = f32::NAN;
        let bytes = update_to_safetensors(&nan, &spec).unwrap();
        assert!(matches!(
            update_from_safetensors(&bytes, &spec),
            Err(UpdateError::NotFinite { .. })
        ));
    }
}
