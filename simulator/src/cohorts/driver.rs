//! One round of the cohort tier in virtual time: every node's core, its messages and the
//! synthetic compute it asks for (the learning tier's `hub.rs`, without models).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use kindred_proto::ModelId;
use kindred_proto::rpc::{PushAnswer, RequestId, RpcRequest, RpcResponse, SketchCosine};
use kindred_routing::exchange::{
    Answer, Apply, ExchangeConfig, Input, MergeVerdict, Millis, ModelVerdict, Output, Role,
    RoundReport, SeenHeader,
};
use kindred_routing::keys::{KeyContext, NetworkId, ProbeSequence, RoundWindow};

use super::{
    AGGREGATE_MIN_COSINE, CohortsConfig, CohortsError, CohortsRound, Dht, Keyed, Keys, ROUND_MS,
    Swarm,
};
use crate::routing::workload::{Embeddings, Signatures, dot};

/// A payload's handle: below the node count, that slot's packet; above, a [`Blob`].
pub(crate) type Handle = u32;

/// One-way message latency, ms.
const LATENCY_MS: u64 = 50;
/// A search, from asking to its headers, ms.
const SEARCH_MS: u64 = 2_000;
/// A merge or a check, ms.
const COMPUTE_MS: u64 = 200;
/// An Ed25519 `PeerId` as messages carry it.
const PEER_ID_BYTES: usize = 38;

/// A merge or a model a handle names.
enum Blob {
    /// A merge: its sketch, the nodes it holds, and how many of each task.
    Merge {
        sketch: Vec<f32>,
        weight: f32,
        tasks: Vec<(u16, u32)>,
    },
    /// A hub's model, known by its task.
    Model(u16),
}

/// A packet's or merge's sketch, the nodes it holds, and how many of each task.
struct Payload<'a> {
    sketch: &'a [f32],
    weight: f32,
    tasks: Vec<(u16, u32)>,
}

enum Event {
    Deliver(u32, Input<u32, Handle>),
    Wake(u32),
}

/// A queued event, earliest first.
struct Entry {
    at: u64,
    seq: u64,
    event: Event,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// Encoded sizes of the exchange's messages, without their peer lists.
struct Sizes {
    push: usize,
    answer: usize,
    answer_hint: usize,
    merge: usize,
    fetch_merge: usize,
    model_request: usize,
}

impl Sizes {
    fn new(cfg: &CohortsConfig) -> Self {
        let (header, body) = (vec![0; cfg.header_bytes], vec![0; cfg.packet_bytes]);
        let id = RequestId(1 << 20);
        let fetch_merge = RpcRequest::GetMerge { id, round: 1 << 20 }.encoded_len();
        Self {
            push: RpcRequest::Push {
                id,
                round: 1 << 20,
                header: header.clone(),
                body: body.clone(),
                known: Vec::new(),
            }
            .encoded_len(),
            answer: RpcResponse::PushAnswer {
                id,
                answer: PushAnswer::Accepted,
            }
            .encoded_len(),
            answer_hint: RpcResponse::PushAnswer {
                id,
                answer: PushAnswer::NotHub {
                    hub: vec![0; PEER_ID_BYTES],
                },
            }
            .encoded_len(),
            merge: fetch_merge
                + RpcResponse::Merge {
                    id,
                    header,
                    body,
                    // A cosine within a task: 3 bytes, as any of magnitude ≥ 0.82.
                    cosine: SketchCosine::from_f32(0.97),
                    // A lineage is a 64-bit hash: 10 bytes as a varint, mostly.
                    lineage: u64::MAX,
                    listed: Vec::new(),
                }
                .encoded_len(),
            fetch_merge,
            model_request: RpcRequest::GetSnapshot { id }.encoded_len(),
        }
    }
}

struct Driver<'a> {
    cfg: &'a CohortsConfig,
    emb: &'a Embeddings,
    sigs: &'a Signatures,
    n: usize,
    round: u64,
    sizes: Sizes,
    blobs: Vec<Blob>,
    queue: BinaryHeap<Entry>,
    seq: u64,
    messages: u64,
    /// Searches asked for at the current time: identity, whether it announces, probes.
    searches: Vec<(u32, bool, usize)>,
    /// Per slot, how its round ended.
    reports: Vec<Option<RoundReport<u32, Handle>>>,
    /// Per slot, the time of its pending wake.
    wakes: Vec<Option<Millis>>,
    /// Pushes each merge took in.
    fan_in: Vec<usize>,
    models: HashMap<u32, Handle>,
    dht_bytes: u64,
    exchange_bytes: u64,
    searched: usize,
}

/// Run round `round` for every node of `swarm`.
pub(crate) fn round(
    cfg: &CohortsConfig,
    emb: &Embeddings,
    sigs: &Signatures,
    swarm: &mut Swarm,
    dht: &mut Dht,
    round: u64,
) -> Result<CohortsRound, CohortsError> {
    let n = swarm.cores.len();
    let start = Millis(round * ROUND_MS);
    let deadline = start.saturating_add(ROUND_MS);
    let mut d = Driver {
        cfg,
        emb,
        sigs,
        n,
        round,
        sizes: Sizes::new(cfg),
        blobs: Vec::new(),
        queue: BinaryHeap::new(),
        seq: 0,
        messages: 0,
        searches: Vec::new(),
        reports: (0..n).map(|_| None).collect(),
        wakes: vec![None; n],
        fan_in: Vec::new(),
        models: HashMap::new(),
        dht_bytes: 0,
        exchange_bytes: 0,
        searched: 0,
    };
    for slot in 0..n {
        if let Some(core) = swarm.cores.get_mut(slot) {
            core.handle(start, Input::RoundStart { round, deadline });
            core.handle(
                start,
                Input::PacketReady {
                    round,
                    packet: slot as Handle,
                },
            );
        }
        d.drain(swarm, slot, start);
    }
    let mut now = start;
    loop {
        if !d.searches.is_empty() {
            d.search(swarm, dht, now)?;
        }
        let Some(Entry { at, event, .. }) = d.queue.pop() else {
            break;
        };
        if at > deadline.0 {
            break;
        }
        now = Millis(at);
        let (id, input) = match event {
            Event::Deliver(id, input) => (id, Some(input)),
            Event::Wake(id) => (id, None),
        };
        let Some(slot) = swarm.slot(id) else {
            continue;
        };
        let Some(core) = swarm.cores.get_mut(slot) else {
            continue;
        };
        match input {
            Some(input) => core.handle(now, input),
            None => {
                if let Some(w) = d.wakes.get_mut(slot).filter(|w| **w == Some(now)) {
                    *w = None;
                }
                core.handle_timeout(now);
            }
        }
        d.drain(swarm, slot, now);
    }
    for slot in 0..n {
        if let Some(core) = swarm.cores.get_mut(slot) {
            core.handle_timeout(deadline);
        }
        d.drain(swarm, slot, deadline);
    }
    Ok(d.measure(swarm))
}

impl Driver<'_> {
    fn schedule(&mut self, at: Millis, event: Event) {
        self.seq += 1;
        self.queue.push(Entry {
            at: at.0,
            seq: self.seq,
            event,
        });
    }

    /// Send `input` to `to` unless the message is lost; counts `bytes` on the wire either way.
    fn send(&mut self, now: Millis, to: u32, input: Input<u32, Handle>, bytes: usize) {
        self.exchange_bytes += bytes as u64;
        self.messages += 1;
        let p = self.cfg.msg_loss;
        let lost = p > 0.0
            && crate::rng::unit_open(crate::rng::hash_words(
                self.cfg.seed,
                &[0x1055, self.round, self.messages],
            )) < p;
        if !lost {
            self.schedule(now.saturating_add(LATENCY_MS), Event::Deliver(to, input));
        }
    }

    /// The task of the packet in `slot`.
    fn task(&self, slot: usize) -> u16 {
        self.emb.cluster(slot as u32)
    }

    /// Cosine of the sketches of identities `a` and `b` (their slots' packets).
    fn cosine(&self, swarm: &Swarm, a: u32, b: u32) -> f32 {
        match (swarm.slot(a), swarm.slot(b)) {
            (Some(x), Some(y)) => self.emb.cosine(x as u32, y as u32),
            _ => f32::NEG_INFINITY,
        }
    }

    /// The sketch a search ranks by: that of the node's model (see [`Keys`]).
    fn searched_sketch<'s>(&'s self, swarm: &'s Swarm, id: u32) -> &'s [f32] {
        let Some(slot) = swarm.slot(id) else {
            return &[];
        };
        match swarm.keyed.get(slot).and_then(Option::as_ref) {
            Some(k) => &k.sketch,
            None => self.emb.vec(slot as u32),
        }
    }

    /// Cosine of the sketches a search compares: the searcher's and a provider's record.
    fn search_cosine(&self, swarm: &Swarm, a: u32, b: u32) -> f32 {
        dot(
            self.searched_sketch(swarm, a),
            self.searched_sketch(swarm, b),
        )
    }

    /// What a packet or merge handle holds.
    fn payload(&self, h: Handle) -> Option<Payload<'_>> {
        if (h as usize) < self.n {
            return Some(Payload {
                sketch: self.emb.vec(h),
                weight: 1.0,
                tasks: vec![(self.task(h as usize), 1)],
            });
        }
        match self.blobs.get(h as usize - self.n)? {
            Blob::Merge {
                sketch,
                weight,
                tasks,
            } => Some(Payload {
                sketch,
                weight: *weight,
                tasks: tasks.clone(),
            }),
            Blob::Model(_) => None,
        }
    }

    fn add_blob(&mut self, blob: Blob) -> Handle {
        self.blobs.push(blob);
        (self.n + self.blobs.len() - 1) as Handle
    }

    /// Carry out every output of the core in `slot`, and schedule its next timer.
    fn drain(&mut self, swarm: &mut Swarm, slot: usize, now: Millis) {
        let Some(&id) = swarm.id_of.get(slot) else {
            return;
        };
        while let Some(out) = swarm.cores.get_mut(slot).and_then(|c| c.poll_output()) {
            self.carry(swarm, slot, id, now, out);
        }
        if let Some(t) = swarm.cores.get(slot).and_then(|c| c.poll_timeout()) {
            let at = t.max(now);
            if let Some(w) = self.wakes.get_mut(slot).filter(|w| **w != Some(at)) {
                *w = Some(at);
                self.schedule(at, Event::Wake(id));
            }
        }
    }

    fn carry(
        &mut self,
        swarm: &Swarm,
        slot: usize,
        id: u32,
        now: Millis,
        out: Output<u32, Handle>,
    ) {
        match out {
            Output::Search {
                announce, probes, ..
            } => self.searches.push((id, announce, probes)),
            Output::FetchModel { ticket, hub } => {
                // One model blob per hub and round, shared by every member that fetches it.
                let model = swarm.slot(hub).map(|s| match self.models.get(&hub) {
                    Some(&h) => h,
                    None => {
                        let h = self.add_blob(Blob::Model(self.task(s)));
                        self.models.insert(hub, h);
                        h
                    }
                });
                // The request, and the snapshot if the hub is still there to answer.
                let bytes = self.sizes.model_request + model.map_or(0, |_| self.cfg.snapshot_bytes);
                self.send(now, id, Input::ModelReceived { ticket, model }, bytes);
            }
            Output::CheckModel { ticket, model, .. } => {
                let verdict = match self.blobs.get((model as usize).wrapping_sub(self.n)) {
                    Some(Blob::Model(task)) if *task == self.task(slot) => ModelVerdict::Adopt,
                    _ => ModelVerdict::Refuse,
                };
                self.schedule(
                    now.saturating_add(COMPUTE_MS),
                    Event::Deliver(id, Input::ModelChecked { ticket, verdict }),
                );
            }
            Output::Push {
                to,
                packet,
                known,
                via,
                ..
            } => {
                let bytes = self.sizes.push + known.len() * (PEER_ID_BYTES + 1);
                let input = Input::PushReceived {
                    from: id,
                    rank: swarm.rank(id),
                    round: self.round,
                    packet,
                    cosine: self.cosine(swarm, to, id),
                    known,
                    via,
                };
                self.send(now, to, input, bytes);
            }
            Output::Answer { to, answer, .. } => {
                let bytes = match answer {
                    Answer::NotHub { .. } | Answer::Full { .. } => self.sizes.answer_hint,
                    _ => self.sizes.answer,
                };
                let answer = answer.ranked_by(|p| swarm.rank(*p));
                let input = Input::AnswerReceived {
                    from: id,
                    round: self.round,
                    answer,
                };
                self.send(now, to, input, bytes);
            }
            Output::Merge {
                ticket,
                own,
                members,
                ..
            } => {
                self.fan_in.push(members.len());
                let merge = self.merge(own, &members);
                self.schedule(
                    now.saturating_add(COMPUTE_MS),
                    Event::Deliver(id, Input::MergeComputed { ticket, merge }),
                );
            }
            Output::CheckMerge {
                ticket,
                merge,
                own,
                by_data,
                ..
            } => {
                let verdict = self.check(merge, own, by_data, self.task(slot));
                self.schedule(
                    now.saturating_add(COMPUTE_MS),
                    Event::Deliver(id, Input::MergeChecked { ticket, verdict }),
                );
            }
            Output::ServeMerge {
                to,
                merge,
                lineage,
                listed,
                ..
            } => {
                let listing = listed.len() * (PEER_ID_BYTES + 1);
                for r in to {
                    let bytes = self.sizes.merge + if r.listed { listing } else { 0 };
                    let input = Input::MergeReceived {
                        from: id,
                        round: self.round,
                        merge,
                        cosine: r.cosine,
                        lineage,
                        listed: if r.listed { listed.clone() } else { Vec::new() },
                    };
                    self.send(now, r.peer, input, bytes);
                }
            }
            Output::FetchMerge { hub, round } => {
                let bytes = self.sizes.fetch_merge;
                self.send(now, hub, Input::MergeAsked { from: id, round }, bytes);
            }
            Output::Ban { .. } => {}
            Output::Finished(report) => {
                if let Some(r) = self.reports.get_mut(slot) {
                    *r = Some(report);
                }
            }
        }
    }

    /// The sample-weighted mean of `own` and the members' payloads, with their tasks.
    fn merge(&mut self, own: Handle, members: &[(u32, Handle)]) -> Option<Handle> {
        let dim = self.emb.dim();
        let mut sketch = vec![0f32; dim];
        let mut weight = 0f32;
        let mut tasks: Vec<(u16, u32)> = Vec::new();
        for h in std::iter::once(own).chain(members.iter().map(|m| m.1)) {
            let Some(Payload {
                sketch: v,
                weight: w,
                tasks: t,
            }) = self.payload(h)
            else {
                continue;
            };
            for (s, x) in sketch.iter_mut().zip(v) {
                *s += w * x;
            }
            weight += w;
            for (task, count) in t {
                match tasks.iter_mut().find(|(k, _)| *k == task) {
                    Some(e) => e.1 += count,
                    None => tasks.push((task, count)),
                }
            }
        }
        if weight <= 0.0 {
            return None;
        }
        let norm = dot(&sketch, &sketch).sqrt().max(1e-12);
        sketch.iter_mut().for_each(|s| *s /= norm);
        Some(self.add_blob(Blob::Merge {
            sketch,
            weight,
            tasks,
        }))
    }

    /// The aggregate check (direction against the node's own sketch) and the data check (a
    /// majority of the merge's nodes of the node's task).
    fn check(&self, merge: Handle, own: Handle, by_data: bool, task: u16) -> MergeVerdict {
        let (Some(m), Some(o)) = (self.payload(merge), self.payload(own)) else {
            return MergeVerdict::Aggregate;
        };
        if dot(m.sketch, o.sketch) < AGGREGATE_MIN_COSINE {
            return MergeVerdict::Aggregate;
        }
        let total: u32 = m.tasks.iter().map(|t| t.1).sum();
        let mine = m.tasks.iter().find(|t| t.0 == task).map_or(0, |t| t.1);
        if by_data && 2 * mine < total {
            return MergeVerdict::Data;
        }
        MergeVerdict::Pass
    }

    /// The searches asked for at `now`: announcements first, then lookups; each searcher gets
    /// the providers its keys hold, ranked by sketch cosine, `SEARCH_MS` later.
    fn search(&mut self, swarm: &Swarm, dht: &mut Dht, now: Millis) -> Result<(), CohortsError> {
        let searches = std::mem::take(&mut self.searches);
        self.searched += searches.len();
        let key_window = swarm.config.key_window.max(1);
        let window = RoundWindow(self.round / key_window);
        dht.set_window(window.0);
        let ctx = KeyContext::new(
            NetworkId::from_name("kindred-sim"),
            ModelId([0; 32]),
            window,
            ExchangeConfig::keys(),
        );
        let keys = ctx.config();
        for &(id, announce, _) in &searches {
            let Some(slot) = swarm.slot(id).filter(|_| announce) else {
                continue;
            };
            let sig = match swarm.keyed.get(slot).and_then(Option::as_ref) {
                Some(k) => k.sig,
                None => self.sigs.sig(slot as u32),
            };
            for band in 0..keys.bands() {
                let key = ctx.band_key(band, keys.band_value(&sig, band));
                self.dht_bytes += dht.announce(&key, id);
            }
        }
        let max = swarm.config.max_providers;
        for (id, _, probes) in searches {
            let Some(slot) = swarm.slot(id) else {
                continue;
            };
            let keyed = swarm.keyed.get(slot).and_then(Option::as_ref);
            let sig = keyed.map_or_else(|| self.sigs.sig(slot as u32), |k| k.sig);
            let mut origins: Vec<(usize, u64)> = (0..keys.bands())
                .map(|b| (b, keys.band_value(&sig, b)))
                .collect();
            if probes > 0 {
                let margins = match keyed {
                    Some(k) => k.margins.clone(),
                    None => self.sigs.margins(self.emb, slot as u32)?,
                };
                let seq = ProbeSequence::new(&sig, &margins, keys)?;
                origins.extend(seq.take(probes).map(|p| (usize::from(p.band), p.value)));
            }
            let mut found: Vec<u32> = Vec::new();
            for (band, value) in origins {
                let (providers, bytes) = dht.lookup(&ctx.band_key(band, value));
                self.dht_bytes += bytes;
                for &p in providers {
                    if p != id && !found.contains(&p) && swarm.slot(p).is_some() {
                        found.push(p);
                    }
                }
            }
            let mut headers: Vec<SeenHeader<u32>> = found
                .into_iter()
                .map(|p| {
                    let hub = swarm
                        .slot(p)
                        .and_then(|s| swarm.last_hub.get(s).copied().flatten())
                        .unwrap_or(p);
                    SeenHeader {
                        peer: p,
                        rank: swarm.rank(p),
                        cosine: self.search_cosine(swarm, id, p),
                        hub,
                        hub_rank: swarm.rank(hub),
                    }
                })
                .collect();
            headers.sort_by(|a, b| b.cosine.total_cmp(&a.cosine).then(a.peer.cmp(&b.peer)));
            headers.truncate(max);
            self.schedule(
                now.saturating_add(SEARCH_MS),
                Event::Deliver(
                    id,
                    Input::SearchDone {
                        round: self.round,
                        headers,
                    },
                ),
            );
        }
        Ok(())
    }

    /// The round's trees, from every node's report; the hubs each node pushed to become the
    /// headers' hubs of the next round.
    fn measure(self, swarm: &mut Swarm) -> CohortsRound {
        let n = self.n;
        // A node is in its hub's tree when it applied the tree's merge or took its hub's
        // model: a push that got neither (a late or refused one, an idle hub's push to its
        // next rank) joins nothing.
        let hub_slot = |slot: usize| -> Option<usize> {
            match self.reports.get(slot).and_then(Option::as_ref) {
                Some(r)
                    if r.role == Role::Member
                        && matches!(r.apply, Apply::Merge { .. } | Apply::Adopt(_)) =>
                {
                    swarm.slot(r.hub).filter(|&h| h != slot)
                }
                _ => None,
            }
        };
        let mut roots = vec![0u32; n];
        let mut depth_max = 0;
        for (slot, root) in roots.iter_mut().enumerate() {
            let (mut at, mut depth) = (slot, 0);
            while let Some(h) = hub_slot(at) {
                at = h;
                depth += 1;
                if depth > 64 {
                    break;
                }
            }
            *root = at as u32;
            depth_max = depth_max.max(depth);
        }
        // Per root, its nodes by task; per task, its nodes.
        let mut trees: HashMap<(u32, u16), u32> = HashMap::new();
        let mut sizes: HashMap<u32, u32> = HashMap::new();
        let mut per_task: HashMap<u16, u32> = HashMap::new();
        // Nodes in their local rounds (new ones) take no part yet.
        let local = |slot: usize| {
            self.reports
                .get(slot)
                .and_then(Option::as_ref)
                .is_none_or(|r| r.role == Role::Local)
        };
        let taking_part = (0..n).filter(|&s| !local(s)).count();
        for (slot, &root) in roots.iter().enumerate() {
            if local(slot) {
                continue;
            }
            let task = self.task(slot);
            *trees.entry((root, task)).or_default() += 1;
            *sizes.entry(root).or_default() += 1;
            *per_task.entry(task).or_default() += 1;
        }
        let mut largest: HashMap<u16, u32> = HashMap::new();
        let mut majority: HashMap<u32, u32> = HashMap::new();
        for (&(root, task), &count) in &trees {
            let l = largest.entry(task).or_default();
            *l = (*l).max(count);
            let m = majority.entry(root).or_default();
            *m = (*m).max(count);
        }
        let shares: Vec<f64> = per_task
            .iter()
            .map(|(task, &count)| {
                f64::from(largest.get(task).copied().unwrap_or(0)) / f64::from(count.max(1))
            })
            .collect();
        let mut fan_in = self.fan_in.clone();
        fan_in.sort_unstable();
        let p99 = fan_in
            .get((fan_in.len() * 99 / 100).min(fan_in.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0);
        let missed = self.reports.iter().flatten().filter(|r| r.missed).count();
        let mut shared: HashMap<Handle, Arc<Keyed>> = HashMap::new();
        for (slot, report) in self.reports.iter().enumerate() {
            if let (Some(last), Some(r)) = (swarm.last_hub.get_mut(slot), report)
                && !matches!(r.apply, Apply::Nothing)
            {
                *last = Some(r.hub);
            }
            // A node keys on its model: after it applies a merge, on that merge's sketch.
            let applied = match report {
                Some(RoundReport {
                    apply: Apply::Merge { merge, .. },
                    ..
                }) if self.cfg.keys == Keys::Model && (*merge as usize) >= n => Some(*merge),
                _ => None,
            };
            let keyed = applied.and_then(|h| {
                if let Some(k) = shared.get(&h) {
                    return Some(Arc::clone(k));
                }
                let Some(Blob::Merge { sketch, .. }) = self.blobs.get(h as usize - n) else {
                    return None;
                };
                let (sig, margins) = self.sigs.hash(sketch).ok()?;
                let k = Arc::new(Keyed {
                    sig,
                    margins,
                    sketch: sketch.clone(),
                });
                shared.insert(h, Arc::clone(&k));
                Some(k)
            });
            if let (Some(k), Some(keyed)) = (swarm.keyed.get_mut(slot), keyed) {
                *k = Some(keyed);
            }
        }
        let per_node = |b: u64| b as f64 / n.max(1) as f64;
        CohortsRound {
            round: self.round,
            nodes: taking_part,
            replaced: 0,
            largest_tree_share_min: if shares.is_empty() {
                0.0
            } else {
                shares.iter().copied().fold(1.0, f64::min)
            },
            largest_tree_share_mean: if shares.is_empty() {
                0.0
            } else {
                shares.iter().sum::<f64>() / shares.len() as f64
            },
            trees: sizes.values().filter(|&&s| s > 1).count(),
            alone: sizes.values().filter(|&&s| s == 1).count(),
            depth_max,
            members_per_hub_max: fan_in.last().copied().unwrap_or(0),
            members_per_hub_p99: p99,
            purity: if taking_part == 0 {
                1.0
            } else {
                f64::from(majority.values().sum::<u32>()) / taking_part as f64
            },
            dht_bytes_per_node: per_node(self.dht_bytes),
            exchange_bytes_per_node: per_node(self.exchange_bytes),
            searches: self.searched,
            missed,
            seconds: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_pop_earliest_first_then_in_order_sent() {
        let mut q = BinaryHeap::new();
        for (at, seq) in [(5, 1), (3, 2), (5, 0), (9, 3)] {
            q.push(Entry {
                at,
                seq,
                event: Event::Wake(0),
            });
        }
        let order: Vec<(u64, u64)> =
            std::iter::from_fn(|| q.pop().map(|e| (e.at, e.seq))).collect();
        assert_eq!(order, vec![(3, 2), (5, 0), (5, 1), (9, 3)]);
    }
}
