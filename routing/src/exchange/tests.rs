//! Unit tests of the exchange core: nodes driven by hand, messages handed over as values.

use super::*;

type Node = Exchange<u32, &'static str>;

fn config() -> ExchangeConfig {
    ExchangeConfig {
        local_rounds: 0,
        ..ExchangeConfig::default()
    }
}

fn drain(node: &mut Node) -> Vec<Output<u32, &'static str>> {
    std::iter::from_fn(|| node.poll_output()).collect()
}

fn finished(outputs: &[Output<u32, &'static str>]) -> Option<RoundReport<u32, &'static str>> {
    outputs.iter().find_map(|o| match o {
        Output::Finished(r) => Some(r.clone()),
        _ => None,
    })
}

/// Starts round `round` (deadline 1 s later) with packet `packet` at a node that knows `hub`.
/// A round-0 push from `(peer, rank)` that knows no other peer.
fn push(node: &mut Node, now: Millis, (from, rank): (u32, u64), packet: &'static str, cosine: f32) {
    node.handle(
        now,
        Input::PushReceived {
            from,
            rank,
            round: 0,
            packet,
            cosine,
            known: Vec::new(),
            via: None,
        },
    );
}

/// Member `peer` served with the listing, its push having come at cosine 0.97.
fn listed_at_097(peer: u32) -> Vec<Recipient<u32>> {
    vec![Recipient {
        peer,
        listed: true,
        cosine: 0.97,
    }]
}

/// Hub `from`'s answer to the node's push of `round` arrives at `now`.
fn answer(node: &mut Node, now: u64, from: u32, round: u64, answer: Answer<u32>) {
    node.handle(
        Millis(now),
        Input::AnswerReceived {
            from,
            round,
            answer,
        },
    );
}

fn start(node: &mut Node, round: u64, packet: &'static str) -> Vec<Output<u32, &'static str>> {
    let t = Millis(round * 1_000);
    node.handle(
        t,
        Input::RoundStart {
            round,
            deadline: t.saturating_add(1_000),
        },
    );
    node.handle(t, Input::PacketReady { round, packet });
    drain(node)
}

#[test]
fn a_local_round_applies_the_own_update_and_answers_pushes_busy() {
    let mut node = Node::new(1, 10, ExchangeConfig::default());
    node.handle(
        Millis(0),
        Input::RoundStart {
            round: 0,
            deadline: Millis(1_000),
        },
    );
    push(&mut node, Millis(1), (2, 20), "p2", 0.99);
    assert!(matches!(
        drain(&mut node).as_slice(),
        [Output::Answer {
            to: 2,
            answer: Answer::Busy,
            ..
        }]
    ));
    node.handle(
        Millis(2),
        Input::PacketReady {
            round: 0,
            packet: "p1",
        },
    );
    let report = finished(&drain(&mut node)).unwrap();
    assert_eq!((report.role, report.apply), (Role::Local, Apply::Own("p1")));
}

#[test]
fn a_member_joins_its_hub_and_applies_its_checked_merge() {
    let mut hub = Node::new(1, 10, config());
    let mut member = Node::new(2, 20, config());
    member.handle(
        Millis(0),
        Input::RoundStart {
            round: 0,
            deadline: Millis(1_000),
        },
    );
    hub.handle(
        Millis(0),
        Input::RoundStart {
            round: 0,
            deadline: Millis(1_000),
        },
    );
    // The member found the hub in an earlier search.
    member.view.learn([(1, 10)]);
    member.handle(
        Millis(1),
        Input::PacketReady {
            round: 0,
            packet: "p2",
        },
    );
    let Some(Output::FetchModel { ticket, hub: 1 }) = member.poll_output() else {
        panic!("a joining member fetches the hub's model first");
    };
    check_model(&mut member, Millis(2), ticket, "m1", ModelVerdict::Adopt);
    let Some(Output::Push {
        to: 1,
        round: 0,
        packet,
        known,
        via: None,
    }) = member.poll_output()
    else {
        panic!("then pushes");
    };
    hub.handle(
        Millis(4),
        Input::PushReceived {
            from: 2,
            rank: 20,
            round: 0,
            packet,
            cosine: 0.97,
            known,
            via: None,
        },
    );
    hub.handle(
        Millis(5),
        Input::PacketReady {
            round: 0,
            packet: "p1",
        },
    );
    let out = drain(&mut hub);
    assert!(matches!(
        out.first(),
        Some(Output::Answer {
            to: 2,
            answer: Answer::Accepted { depth: 0 },
            ..
        })
    ));
    assert!(matches!(
        out.get(1),
        Some(Output::Search { announce: true, .. })
    ));
    hub.handle(
        Millis(6),
        Input::SearchDone {
            round: 0,
            headers: Vec::new(),
        },
    );
    // The admission closes at 600 ms.
    assert_eq!(hub.poll_timeout(), Some(Millis(600)));
    hub.handle_timeout(Millis(600));
    let Some(Output::Merge {
        ticket,
        own: "p1",
        members,
        ..
    }) = hub.poll_output()
    else {
        panic!("the hub asks for its merge");
    };
    assert_eq!(members, vec![(2, "p2")]);
    hub.handle(
        Millis(650),
        Input::MergeComputed {
            ticket,
            merge: Some("merge"),
        },
    );
    let out = drain(&mut hub);
    let Some(Output::ServeMerge { to, listed, .. }) = out.first() else {
        panic!("{out:?}");
    };
    // The member gets the listing, and its push's cosine back: its anchor.
    assert_eq!(to, &listed_at_097(2));
    assert_eq!(listed, &vec![(1, 10), (2, 20)]);
    assert_eq!(
        finished(&out).unwrap().apply,
        Apply::Merge {
            merge: "merge",
            adopt: None
        }
    );
    member.handle(
        Millis(660),
        Input::MergeReceived {
            from: 1,
            round: 0,
            merge: "merge",
            cosine: 0.97,
            lineage: member.lineage(),
            listed: listed.clone(),
        },
    );
    let Some(Output::CheckMerge {
        ticket,
        by_data: false,
        own: "p2",
        ..
    }) = member.poll_output()
    else {
        panic!("a first merge is checked by direction and norm only");
    };
    member.handle(
        Millis(670),
        Input::MergeChecked {
            ticket,
            verdict: MergeVerdict::Pass,
        },
    );
    let report = finished(&drain(&mut member)).unwrap();
    assert_eq!(
        report.apply,
        Apply::Merge {
            merge: "merge",
            adopt: Some("m1")
        }
    );
    assert_eq!(
        (report.role, report.hub, report.missed),
        (Role::Member, 1, false)
    );
    assert_eq!(member.joined(), Some(&1));
}

#[test]
fn a_member_with_no_merge_applies_its_own_update_and_drops_a_silent_hub() {
    let mut member = Node::new(2, 20, config());
    member.view.learn([(1, 10), (3, 30)]);
    member.joined = Some(1);
    for round in 0..2 {
        let out = start(&mut member, round, "p2");
        assert!(
            matches!(out.as_slice(), [Output::Push { to: 1, .. }]),
            "{out:?}"
        );
        // No answer within `answer_ms` (capped at the deadline): a miss.
        let t = member.poll_timeout().unwrap();
        assert_eq!(t, Millis(round * 1_000 + 1_000));
        member.handle_timeout(t);
        let report = finished(&drain(&mut member)).unwrap();
        assert_eq!((report.apply, report.missed), (Apply::Own("p2"), true));
    }
    // Two misses in a row: the member forgets hub 1 and is its own hub (3 ranks above it).
    assert_eq!(member.hub(), 2);
    assert_eq!(member.joined(), None);
}

#[test]
fn a_hub_whose_merge_fails_is_banned_at_once_and_joined_anew_when_its_ban_ends() {
    let config = ExchangeConfig {
        ban_rounds: 3,
        ..config()
    };
    let mut member = Node::new(2, 20, config);
    member.view.learn([(1, 10), (3, 30)]);
    member.joined = Some(1);
    let out = start(&mut member, 4, "p2");
    assert!(pushes_to(&out, 1), "{out:?}");
    answer(&mut member, 4_010, 1, 4, Answer::Accepted { depth: 0 });
    member.handle(
        Millis(4_700),
        Input::MergeReceived {
            from: 1,
            round: 4,
            merge: "lie",
            cosine: 0.97,
            lineage: member.lineage(),
            listed: Vec::new(),
        },
    );
    let Some(Output::CheckMerge { ticket, .. }) = member.poll_output() else {
        panic!("the member checks the merge");
    };
    member.handle(
        Millis(4_710),
        Input::MergeChecked {
            ticket,
            verdict: MergeVerdict::Aggregate,
        },
    );
    let out = drain(&mut member);
    assert!(
        matches!(out.first(), Some(Output::Ban { peer: 1 })),
        "one failed merge bans: {out:?}"
    );
    assert_eq!(finished(&out).unwrap().apply, Apply::Own("p2"));
    assert_eq!(member.joined(), None);
    // Banned for rounds 5 and 6: told of it again, the member does not take it back.
    for round in 5..7 {
        let out = start(&mut member, round, "p2");
        assert!(!pushes_to(&out, 1) && !fetches_from(&out, 1), "{out:?}");
        assert_eq!(member.view.learn([(1, 10)]), 0);
        member.handle_timeout(Millis(round * 1_000 + 1_000));
        let _ = drain(&mut member);
    }
    // From round 7 it may learn it again, and joins it anew: its model is checked first.
    let _ = start(&mut member, 7, "p2");
    assert_eq!(member.view.learn([(1, 10)]), 1);
    member.handle_timeout(Millis(8_000));
    let _ = drain(&mut member);
    let out = start(&mut member, 8, "p2");
    assert!(fetches_from(&out, 1), "{out:?}");
}

#[test]
fn a_doubtful_merge_is_refused_and_its_hub_banned_at_the_second_in_a_row() {
    let mut member = Node::new(2, 20, config());
    member.view.learn([(1, 10), (3, 30)]);
    member.joined = Some(1);
    // Round `round`'s merge from hub 1, checked with `verdict`: the round's outputs.
    let mut round_with = |round: u64, verdict| {
        let out = start(&mut member, round, "p2");
        assert!(pushes_to(&out, 1), "round {round}: {out:?}");
        let t = round * 1_000;
        answer(&mut member, t + 10, 1, round, Answer::Accepted { depth: 0 });
        member.handle(
            Millis(t + 700),
            Input::MergeReceived {
                from: 1,
                round,
                merge: "merge",
                cosine: 0.97,
                lineage: member.lineage(),
                listed: Vec::new(),
            },
        );
        let Some(Output::CheckMerge { ticket, .. }) = member.poll_output() else {
            panic!("the member checks the merge");
        };
        member.handle(Millis(t + 710), Input::MergeChecked { ticket, verdict });
        let out = drain(&mut member);
        (
            finished(&out).unwrap().apply,
            out.iter().any(|o| matches!(o, Output::Ban { peer: 1 })),
        )
    };
    // A doubt, a pass, a doubt: refused twice, never banned; the hub stays.
    assert_eq!(
        round_with(4, MergeVerdict::Doubt),
        (Apply::Own("p2"), false)
    );
    let merged = Apply::Merge {
        merge: "merge",
        adopt: None,
    };
    assert_eq!(round_with(5, MergeVerdict::Pass), (merged, false));
    assert_eq!(
        round_with(6, MergeVerdict::Doubt),
        (Apply::Own("p2"), false)
    );
    // A second doubt in a row bans it.
    assert_eq!(round_with(7, MergeVerdict::Doubt), (Apply::Own("p2"), true));
    assert_eq!(member.joined(), None);
    assert_eq!(member.hub(), 2);
}

/// The node's model fetch `ticket` brings `model`, and its data gives `verdict`.
fn check_model(
    node: &mut Node,
    now: Millis,
    ticket: Ticket,
    model: &'static str,
    verdict: ModelVerdict,
) {
    node.handle(
        now,
        Input::ModelReceived {
            ticket,
            model: Some(model),
        },
    );
    let Some(Output::CheckModel { ticket, .. }) = node.poll_output() else {
        panic!("the model is checked");
    };
    node.handle(now, Input::ModelChecked { ticket, verdict });
}

/// The ticket of the model fetch from `hub` in `out`.
fn fetch_ticket(out: &[Output<u32, &'static str>], hub: u32) -> Ticket {
    out.iter()
        .find_map(|o| match o {
            Output::FetchModel { ticket, hub: h } if *h == hub => Some(*ticket),
            _ => None,
        })
        .expect("a model fetch")
}

/// The model fetch of `ticket` fails at `now` (the hub is gone).
fn model_lost(node: &mut Node, now: u64, ticket: Ticket) {
    node.handle(
        Millis(now),
        Input::ModelReceived {
            ticket,
            model: None,
        },
    );
}

#[test]
fn a_hub_whose_model_cannot_be_fetched_is_dropped_and_the_next_rank_joined_that_round() {
    let mut member = Node::new(3, 30, config());
    member.view.learn([(1, 10), (2, 20)]);
    let out = start(&mut member, 0, "p3");
    // The lowest rank left the swarm: its fetch fails outright.
    model_lost(&mut member, 10, fetch_ticket(&out, 1));
    let out = drain(&mut member);
    assert!(fetches_from(&out, 2), "{out:?}");
    assert!(!out.iter().any(|o| matches!(o, Output::Ban { .. })));
    // Its peers still name it; it stays out of the view for `dropped_rounds`.
    assert_eq!(member.view.learn([(1, 10)]), 0);
    assert_eq!(member.hub(), 2);
    member.view.lift_bans(config().dropped_rounds);
    assert_eq!(member.view.learn([(1, 10)]), 1);
}

#[test]
fn a_model_fetch_answered_after_its_retry_left_still_joins_the_hub() {
    let mut cfg = config();
    cfg.timing.answer_ms = 100;
    let mut member = Node::new(2, 20, cfg.clone());
    member.view.learn([(1, 10)]);
    let first = fetch_ticket(&start(&mut member, 0, "p2"), 1);
    // No answer within `answer_ms` (a hole still being punched, a slow link): sent again.
    member.handle_timeout(Millis(100));
    let retry = fetch_ticket(&drain(&mut member), 1);
    assert_ne!(first, retry);
    // The first fetch failing says nothing of the retry in flight: the hub is not dropped.
    model_lost(&mut member, 120, first);
    assert!(drain(&mut member).is_empty());
    assert_eq!(member.hub(), 1, "the hub is kept");
    check_model(&mut member, Millis(150), retry, "m1", ModelVerdict::Adopt);
    assert!(pushes_to(&drain(&mut member), 1));
    // A first answer arriving late is as good as the retry's.
    let mut other = Node::new(2, 20, cfg);
    other.view.learn([(1, 10)]);
    let first = fetch_ticket(&start(&mut other, 0, "p2"), 1);
    other.handle_timeout(Millis(100));
    let retry = fetch_ticket(&drain(&mut other), 1);
    check_model(&mut other, Millis(150), first, "m1", ModelVerdict::Adopt);
    let out = drain(&mut other);
    assert!(pushes_to(&out, 1), "{out:?}");
    // The retry's answer, after that, changes nothing.
    other.handle(
        Millis(160),
        Input::ModelReceived {
            ticket: retry,
            model: Some("m1"),
        },
    );
    assert!(drain(&mut other).is_empty());
}

#[test]
fn a_hub_whose_model_is_refused_is_forgotten_then_banned_the_second_time() {
    let mut member = Node::new(2, 20, config());
    member.view.learn([(1, 10)]);
    let out = start(&mut member, 0, "p2");
    check_model(
        &mut member,
        Millis(0),
        fetch_ticket(&out, 1),
        "m",
        ModelVerdict::Refuse,
    );
    let after = drain(&mut member);
    assert!(
        !after.iter().any(|o| matches!(o, Output::Ban { .. })),
        "{after:?}"
    );
    assert_eq!(member.hub(), 2, "it forgets the hub and heads itself");
    member.handle_timeout(Millis(1_000));
    let _ = drain(&mut member);
    // Relearned (a search, a listing), its model is refused again: banned.
    assert_eq!(member.view.learn([(1, 10)]), 1);
    let out = start(&mut member, 1, "p2");
    let t = Millis(1_000);
    check_model(
        &mut member,
        t,
        fetch_ticket(&out, 1),
        "m",
        ModelVerdict::Refuse,
    );
    let after = drain(&mut member);
    assert!(
        after.iter().any(|o| matches!(o, Output::Ban { peer: 1 })),
        "{after:?}"
    );
    assert_eq!(member.view.learn([(1, 10)]), 0);
}

#[test]
fn a_member_its_hub_refuses_joins_it_anew_and_takes_its_model_if_refused_again() {
    let mut member = Node::new(2, 20, config());
    member.view.learn([(1, 10)]);
    member.joined = Some(1);
    // Round 0: a member pushes at once, and its hub's gate refuses it (it missed merges).
    let out = start(&mut member, 0, "p2");
    assert!(
        matches!(out.as_slice(), [Output::Push { to: 1, .. }]),
        "{out:?}"
    );
    let refused = Answer::Refused { foreign: false };
    answer(&mut member, 600, 1, 0, refused.clone());
    let report = finished(&drain(&mut member)).unwrap();
    assert_eq!((report.role, report.hub), (Role::Member, 1));
    assert_eq!(member.joined(), None, "it joins anew");
    assert_eq!(member.hub(), 1, "and keeps the hub in its view");
    // Round 1: it fetches the hub's model, its data accepts it, it pushes, is refused again,
    // and takes the model.
    let out = start(&mut member, 1, "p2");
    let [Output::FetchModel { ticket, hub: 1 }] = out.as_slice() else {
        panic!("{out:?}");
    };
    check_model(
        &mut member,
        Millis(1_010),
        *ticket,
        "m1",
        ModelVerdict::Adopt,
    );
    assert!(matches!(
        member.poll_output(),
        Some(Output::Push {
            to: 1,
            round: 1,
            ..
        })
    ));
    answer(&mut member, 1_600, 1, 1, refused);
    let report = finished(&drain(&mut member)).unwrap();
    assert_eq!(report.apply, Apply::Adopt("m1"));
    assert_eq!(member.joined(), Some(&1));
}

#[test]
fn a_hub_refuses_what_its_gate_does_not_admit_and_a_non_hub_names_its_hub() {
    let mut hub = Node::new(1, 10, config());
    hub.view.learn([(0, 5)]);
    let out = start(&mut hub, 0, "p1");
    let [Output::FetchModel { hub: 0, ticket }] = out.as_slice() else {
        panic!("{out:?}");
    };
    // A push to a node joining another hub is held until its data has checked that hub...
    push(&mut hub, Millis(10), (7, 70), "p7", 0.2);
    assert!(matches!(
        drain(&mut hub).as_slice(),
        [Output::Answer {
            to: 7,
            answer: Answer::Accepted { depth: 0 },
            ..
        }]
    ));
    check_model(&mut hub, Millis(20), *ticket, "m0", ModelVerdict::Keep);
    // ...then answered with its hub, which the node pushes to.
    let out = drain(&mut hub);
    assert!(
        matches!(
            out.as_slice(),
            [
                Output::Answer {
                    to: 7,
                    answer: Answer::NotHub { hub: 0, rank: 5 },
                    ..
                },
                Output::Push { to: 0, .. }
            ]
        ),
        "{out:?}"
    );

    let mut alone = Node::new(1, 10, config());
    let _ = start(&mut alone, 0, "p1");
    alone.handle(
        Millis(5),
        Input::SearchDone {
            round: 0,
            headers: Vec::new(),
        },
    );
    for (from, cosine) in [(7, 0.2), (8, 0.98), (9, 0.97)] {
        push(&mut alone, Millis(10), (from, 70), "p", cosine);
    }
    let _ = drain(&mut alone);
    alone.handle_timeout(Millis(600));
    let out = drain(&mut alone);
    assert!(matches!(
        out.first(),
        Some(Output::Answer {
            to: 7,
            answer: Answer::Refused { foreign: false },
            ..
        })
    ));
    let Some(Output::Merge { members, .. }) = out.get(1) else {
        panic!("{out:?}")
    };
    assert_eq!(members.iter().map(|m| m.0).collect::<Vec<_>>(), vec![8, 9]);
}

#[test]
fn a_snapshot_restores_the_same_behaviour_and_refuses_other_versions() {
    let mut node = Node::new(2, 20, config());
    node.view.learn([(1, 10), (3, 30), (4, 40)]);
    node.view.ban(&3, 5);
    node.view.ban(&4, 1);
    node.view.merged(0.93);
    node.joined = Some(1);
    let _ = start(&mut node, 0, "p");
    node.handle_timeout(Millis(1_000));
    let _ = drain(&mut node);

    let bytes = postcard::to_allocvec(&node.snapshot()).unwrap();
    let snapshot: Snapshot<u32> = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(snapshot, node.snapshot());
    let mut restored = Node::restore(config(), snapshot.clone()).unwrap();
    assert_eq!(restored.snapshot(), node.snapshot());
    // Same inputs, same outputs: the second miss drops hub 1 in both; 3 stays banned (to
    // round 5); 4's ban ends at round 1, and it is learned again in both.
    for n in [&mut node, &mut restored] {
        let out = start(n, 1, "p");
        assert!(
            matches!(out.as_slice(), [Output::Push { to: 1, .. }]),
            "{out:?}"
        );
        n.handle_timeout(Millis(2_000));
        let _ = drain(n);
        assert_eq!(n.view.learn([(3, 30), (4, 40)]), 1);
        let known: Vec<u32> = n.cohort().members().copied().collect();
        assert_eq!(known, vec![4]);
    }
    assert_eq!(restored.snapshot(), node.snapshot());
    assert_eq!(restored.hub(), 2);
    assert_eq!(restored.cohort().anchor(), 0.93);

    let mut old = snapshot;
    old.version = SNAPSHOT_VERSION + 1;
    assert_eq!(
        Node::restore(config(), old).err(),
        Some(RestoreError::Version {
            found: SNAPSHOT_VERSION + 1,
            supported: SNAPSHOT_VERSION
        })
    );
}

#[test]
fn a_member_pushes_again_asks_for_its_merge_and_names_its_view_once() {
    let mut cfg = config();
    cfg.timing.answer_ms = 100;
    let mut member = Node::new(2, 20, cfg.clone());
    member.view.learn([(1, 10)]);
    member.joined = Some(1);
    let pushed = |out: &[Output<u32, &'static str>]| {
        out.iter().find_map(|o| match o {
            Output::Push { to: 1, known, .. } => Some(known.len()),
            _ => None,
        })
    };
    // Round 0: the push and its retry go unanswered: the hub is gone.
    assert_eq!(pushed(&start(&mut member, 0, "a")), Some(1));
    member.handle_timeout(Millis(100));
    assert_eq!(pushed(&drain(&mut member)), Some(1), "pushed again");
    member.handle_timeout(Millis(200));
    let report = finished(&drain(&mut member)).unwrap();
    assert!(report.missed);
    assert_eq!(report.apply, Apply::Own("a"));
    assert_eq!(
        member.hub(),
        2,
        "a hub silent to a push and its retry is dropped"
    );
    // Set aside for `dropped_rounds`: a search that finds it (or a peer that names it) does
    // not bring it back until then.
    assert_eq!(member.view.learn([(1, 10)]), 0);
    member.view.lift_bans(cfg.dropped_rounds);
    assert_eq!(member.view.learn([(1, 10)]), 1);
    member.joined = Some(1);
    // Round 1: accepted, but the merge is lost: the member asks for it at 800 permille.
    assert_eq!(pushed(&start(&mut member, 1, "b")), Some(1));
    answer(&mut member, 1_010, 1, 1, Answer::Accepted { depth: 0 });
    assert_eq!(member.poll_timeout(), Some(Millis(1_800)));
    member.handle_timeout(Millis(1_800));
    assert!(matches!(
        drain(&mut member).as_slice(),
        [Output::FetchMerge { hub: 1, round: 1 }]
    ));
    let lineage = member.lineage();
    let merge = |round| Input::MergeReceived {
        from: 1,
        round,
        merge: "m",
        cosine: 0.9,
        lineage,
        listed: Vec::new(),
    };
    member.handle(Millis(1_850), merge(1));
    let Some(Output::CheckMerge { ticket, .. }) = member.poll_output() else {
        panic!("the merge is checked");
    };
    member.handle(
        Millis(1_860),
        Input::MergeChecked {
            ticket,
            verdict: MergeVerdict::Pass,
        },
    );
    assert!(matches!(
        finished(&drain(&mut member)).unwrap().apply,
        Apply::Merge { merge: "m", .. }
    ));
    // Round 2: the hub heard this view with a merge that came back: the push names nobody.
    assert_eq!(pushed(&start(&mut member, 2, "c")), Some(0));
}

#[test]
fn a_hub_serves_its_merge_again_to_an_admitted_member_only() {
    let mut hub = Node::new(1, 10, config());
    hub.handle(
        Millis(0),
        Input::RoundStart {
            round: 0,
            deadline: Millis(1_000),
        },
    );
    push(&mut hub, Millis(1), (2, 20), "p2", 0.97);
    hub.handle(
        Millis(2),
        Input::PacketReady {
            round: 0,
            packet: "p1",
        },
    );
    hub.handle(
        Millis(3),
        Input::SearchDone {
            round: 0,
            headers: Vec::new(),
        },
    );
    hub.handle_timeout(Millis(600));
    let ticket = drain(&mut hub)
        .into_iter()
        .find_map(|o| match o {
            Output::Merge { ticket, .. } => Some(ticket),
            _ => None,
        })
        .unwrap();
    hub.handle(
        Millis(650),
        Input::MergeComputed {
            ticket,
            merge: Some("m"),
        },
    );
    drain(&mut hub);
    hub.handle(Millis(800), Input::MergeAsked { from: 3, round: 0 });
    hub.handle(Millis(801), Input::MergeAsked { from: 2, round: 1 });
    assert!(drain(&mut hub).is_empty(), "not a member, or another round");
    hub.handle(Millis(802), Input::MergeAsked { from: 2, round: 0 });
    let out = drain(&mut hub);
    let [Output::ServeMerge { to, merge: "m", .. }] = out.as_slice() else {
        panic!("{out:?}");
    };
    // Served again with the listing and the cosine its push came with.
    assert_eq!(to, &listed_at_097(2));
}

#[test]
fn a_new_rank_window_can_move_the_hub() {
    let mut node = Node::new(1, 10, config());
    node.view.learn([(2, 20), (3, 30)]);
    assert_eq!(node.hub(), 1);
    node.rerank(1, |p| [0, 50, 40, 5][*p as usize]);
    assert_eq!((node.rank_window(), node.hub()), (1, 3));
    let restored = Node::restore(config(), node.snapshot()).unwrap();
    assert_eq!((restored.rank_window(), restored.hub()), (1, 3));
    assert_eq!(node.window_of(250), 2);
}

/// A hub that served a merge of its members `members` in round 0.
fn hub_that_served(members: &[(u32, u64)]) -> Node {
    let mut node = Node::new(1, 10, config());
    let report = hub_round(&mut node, 0, members);
    assert_eq!(report.role, Role::Hub);
    node
}

#[test]
fn a_new_rank_window_that_moves_the_hub_within_the_cohort_needs_no_model_fetch() {
    // The window makes member 2 the cohort's hub: the old hub pushes to it at once.
    let mut node = hub_that_served(&[(2, 20), (3, 30)]);
    node.rerank(1, |p| [0, 50, 5, 60][*p as usize]);
    assert_eq!(node.hub(), 2);
    let asked = start(&mut node, 1, "p1");
    assert!(
        pushes_to(&asked, 2) && !asked.iter().any(|o| matches!(o, Output::FetchModel { .. })),
        "{asked:?}"
    );
    // A peer that was not in the cohort (it only pushed after the merge) is joined anew.
    let mut node = hub_that_served(&[(2, 20)]);
    node.view.learn([(3, 30)]);
    node.rerank(1, |p| [0, 50, 60, 5][*p as usize]);
    assert_eq!(node.hub(), 3);
    let asked = start(&mut node, 1, "p1");
    assert!(fetches_from(&asked, 3), "{asked:?}");
}

/// Runs round `round` to its deadline (a search finds nobody); returns the node's outputs and
/// its report.
fn idle_round(
    node: &mut Node,
    round: u64,
) -> (
    Vec<Output<u32, &'static str>>,
    RoundReport<u32, &'static str>,
) {
    let mut outputs = start(node, round, "p");
    let t = Millis(round * 1_000);
    if searches(&outputs) {
        let headers = Vec::new();
        node.handle(t.saturating_add(1), Input::SearchDone { round, headers });
    }
    outputs.extend(drain(node));
    node.handle_timeout(t.saturating_add(1_000));
    outputs.extend(drain(node));
    let report = finished(&outputs).unwrap();
    (outputs, report)
}

fn searches(asked: &[Output<u32, &'static str>]) -> bool {
    asked.iter().any(|o| matches!(o, Output::Search { .. }))
}

fn pushes_to(asked: &[Output<u32, &'static str>], hub: u32) -> bool {
    asked
        .iter()
        .any(|o| matches!(o, Output::Push { to, .. } if *to == hub))
}

fn fetches_from(asked: &[Output<u32, &'static str>], from: u32) -> bool {
    asked
        .iter()
        .any(|o| matches!(o, Output::FetchModel { hub, .. } if *hub == from))
}

#[test]
fn a_node_that_knows_nobody_searches_in_the_warm_up_at_window_ends_and_every_search_every() {
    let c = config();
    assert_eq!(
        (c.warmup_searches, c.search_every, c.key_window),
        (3, 10, 10)
    );
    let mut node = Node::new(1, 10, c.clone());
    let searched: Vec<u64> = (0..33)
        .filter(|&round| searches(&idle_round(&mut node, round).0))
        .collect();
    assert_eq!(searched, [0, 1, 2, 4, 9, 10, 19, 20, 29, 30]);
    // Window ends are the swarm's rounds, not the node's: one that started at round 13
    // searches at its exchange rounds 0-2 and 4, at the ends of windows (19, 29) and every
    // `search_every` of its own rounds (23).
    let mut late = Node::new(1, 10, c).with_first_round(13);
    let searched: Vec<u64> = (13..33)
        .filter(|&round| searches(&idle_round(&mut late, round).0))
        .collect();
    assert_eq!(searched, [13, 14, 15, 17, 19, 23, 29]);
}

#[test]
fn a_search_that_left_providers_unread_is_followed_by_one_while_the_view_is_small() {
    let cfg = ExchangeConfig {
        warmup_searches: 1,
        ..config()
    };
    assert_eq!(cfg.probe_below, 3);
    for (peers, again) in [(vec![], true), (vec![(2, 20), (3, 30), (4, 40)], false)] {
        let mut node = Node::new(1, 10, cfg.clone());
        node.view.learn(peers.clone());
        assert!(searches(&start(&mut node, 0, "p")));
        let headers = Vec::new();
        node.handle(Millis(1), Input::SearchDone { round: 0, headers });
        node.search_unreached(0);
        node.handle_timeout(Millis(1_000));
        assert!(finished(&drain(&mut node)).is_some());
        // Round 1 is no scheduled search.
        let (asked, report) = idle_round(&mut node, 1);
        assert_eq!(report.hub, 1);
        assert_eq!(searches(&asked), again, "{} peers: {asked:?}", peers.len());
    }
}

#[test]
fn a_node_that_lost_every_peer_it_knew_searches_in_its_next_round() {
    let mut node = Node::new(1, 30, config()).with_first_round(0);
    node.view.learn([(2, 20)]);
    // Exchange round 5 is no search round: it joins its hub.
    let (asked, _) = idle_round(&mut node, 5);
    assert!(!searches(&asked), "{asked:?}");
    // It refuses its only peer (a lying hub, say): it looks for its task at once...
    node.view.forget(&2);
    assert!(searches(&idle_round(&mut node, 6).0));
    // ...and then keeps to its schedule while it still knows nobody.
    assert!(!searches(&idle_round(&mut node, 7).0));
}

#[test]
fn a_hub_nobody_pushes_to_joins_its_next_rank_for_a_round_then_heads_again() {
    let mut node = Node::new(1, 10, config());
    node.view.learn([(2, 20)]);
    let idle = config().idle_rounds;
    for round in 0..u64::from(idle) {
        let (_, report) = idle_round(&mut node, round);
        assert_eq!((report.role, report.hub), (Role::Hub, 1));
    }
    // Nobody pushed for `idle_rounds`: it joins its next rank (fetches its model first).
    let round = u64::from(idle);
    let (asked, report) = idle_round(&mut node, round);
    assert!(fetches_from(&asked, 2), "{asked:?}");
    assert_eq!((report.role, report.hub), (Role::Member, 2));
    // That round over, it heads its cohort again, and a push is held for its admission.
    let round = round + 1;
    let asked = start(&mut node, round, "p");
    assert!(!searches(&asked) && asked.is_empty(), "{asked:?}");
    let t = Millis(round * 1_000 + 5);
    node.handle(
        t,
        Input::PushReceived {
            from: 2,
            rank: 20,
            round,
            packet: "p2",
            cosine: 0.99,
            known: Vec::new(),
            via: None,
        },
    );
    assert!(matches!(
        drain(&mut node).as_slice(),
        [Output::Answer {
            to: 2,
            answer: Answer::Accepted { depth: 0 },
            ..
        }]
    ));
}

#[test]
fn a_hub_back_after_missing_rounds_takes_its_next_ranks_model_then_heads_again() {
    let mut node = Node::new(1, 10, config());
    node.view.learn([(2, 20)]);
    let (_, report) = idle_round(&mut node, 0);
    assert_eq!((report.role, report.hub), (Role::Hub, 1));
    // A round skipped (started late) is no return: it heads its cohort.
    let gap = config().catch_up_after;
    let (asked, report) = idle_round(&mut node, gap);
    assert_eq!((report.role, report.hub), (Role::Hub, 1), "{asked:?}");
    // Back after missing more rounds: it joins its next rank, fetching its model first, and
    // names that hub to a peer that pushes to it (one that relearned it from a record).
    let back = 2 * gap + 1;
    let t = Millis(back * 1_000);
    let asked = start(&mut node, back, "p1");
    let Some(ticket) = asked.iter().find_map(|o| match o {
        Output::FetchModel { ticket, hub: 2 } => Some(*ticket),
        _ => None,
    }) else {
        panic!("{asked:?}");
    };
    node.handle(
        t.saturating_add(5),
        Input::PushReceived {
            from: 3,
            rank: 30,
            round: back,
            packet: "p3",
            cosine: 0.99,
            known: Vec::new(),
            via: None,
        },
    );
    drain(&mut node);
    check_model(
        &mut node,
        t.saturating_add(6),
        ticket,
        "m2",
        ModelVerdict::Adopt,
    );
    let out = drain(&mut node);
    assert!(
        out.iter().any(|o| matches!(
            o,
            Output::Answer {
                to: 3,
                answer: Answer::NotHub { hub: 2, rank: 20 },
                ..
            }
        )),
        "{out:?}"
    );
    assert!(
        out.iter().any(|o| matches!(o, Output::Push { to: 2, .. })),
        "{out:?}"
    );
    node.handle(
        t.saturating_add(8),
        Input::MergeReceived {
            from: 2,
            round: back,
            merge: "merge",
            cosine: 0.97,
            lineage: node.lineage(),
            listed: vec![(2, 20)],
        },
    );
    let Some(Output::CheckMerge { ticket, .. }) = node.poll_output() else {
        panic!("it checks the merge");
    };
    node.handle(
        t.saturating_add(9),
        Input::MergeChecked {
            ticket,
            verdict: MergeVerdict::Pass,
        },
    );
    let report = finished(&drain(&mut node)).unwrap();
    assert_eq!(
        (report.role, report.hub, report.apply),
        (
            Role::Member,
            2,
            Apply::Merge {
                merge: "merge",
                adopt: Some("m2")
            }
        )
    );
    // Caught up: it heads its cohort again from the next round.
    let (_, report) = idle_round(&mut node, back + 1);
    assert_eq!((report.role, report.hub), (Role::Hub, 1));
}

#[test]
fn a_hub_back_that_cannot_catch_up_heads_again_after_a_bound() {
    let mut node = Node::new(1, 10, config());
    node.view.learn((2..=5).map(|p| (p, u64::from(p) * 10)));
    idle_round(&mut node, 0);
    // The next ranks it joins are silent (and forgotten after misses); it heads again after
    // the bound, still knowing peers.
    let back = config().catch_up_after + 1;
    let roles: Vec<Role> = (back..back + CATCH_UP_ROUNDS + 1)
        .map(|round| idle_round(&mut node, round).1.role)
        .collect();
    let mut expected = vec![Role::Member; CATCH_UP_ROUNDS as usize];
    expected.push(Role::Hub);
    assert_eq!(roles, expected);
    assert!(!node.cohort().is_empty());
}

#[test]
fn a_member_told_of_a_hub_it_outranks_forgets_the_one_it_pushed_to_and_heads() {
    let mut node = Node::new(2, 20, config());
    node.view.learn([(1, 10)]);
    node.joined = Some(1);
    let asked = start(&mut node, 0, "p2");
    assert!(pushes_to(&asked, 1), "{asked:?}");
    // Its hub is catching up at a node this one outranks: itself.
    answer(&mut node, 5, 1, 0, Answer::NotHub { hub: 2, rank: 20 });
    drain(&mut node);
    node.handle(
        Millis(6),
        Input::PushReceived {
            from: 1,
            rank: 10,
            round: 0,
            packet: "p1",
            cosine: 0.99,
            known: Vec::new(),
            via: None,
        },
    );
    assert!(
        matches!(
            drain(&mut node).as_slice(),
            [Output::Answer {
                to: 1,
                answer: Answer::Accepted { depth: 0 },
                ..
            }]
        ),
        "it heads this round and takes the push"
    );
    assert_eq!(node.hub(), 2);
}

#[test]
fn a_node_peers_cannot_dial_keeps_its_hub_when_the_hub_names_it() {
    let mut node = Node::new(2, 20, config());
    node.set_dialable(false);
    node.view.learn([(1, 10)]);
    node.joined = Some(1);
    let asked = start(&mut node, 0, "p2");
    assert!(pushes_to(&asked, 1), "{asked:?}");
    // The hub does not know yet that this node is behind NAT, and names it.
    answer(&mut node, 5, 1, 0, Answer::NotHub { hub: 2, rank: 20 });
    let report = finished(&drain(&mut node)).expect("the round ends at once");
    assert_eq!((report.role, report.hub), (Role::Member, 1));
    assert!(report.missed, "no merge this round: {report:?}");
    // It neither heads nor forgets its hub: it takes no push, and pushes to the hub again.
    assert_eq!(node.hub(), 1);
    let asked = start(&mut node, 1, "p2");
    assert!(pushes_to(&asked, 1), "{asked:?}");
}

#[test]
fn a_member_back_after_missing_rounds_joins_its_hub_anew() {
    let mut node = Node::new(1, 30, config());
    node.view.learn([(2, 20)]);
    node.joined = Some(2);
    // Joined: it pushes at once.
    let asked = start(&mut node, 0, "p");
    assert!(pushes_to(&asked, 2), "{asked:?}");
    node.handle_timeout(Millis(1_000));
    drain(&mut node);
    // Back after missing rounds: its model is behind its hub's, so it fetches it again.
    let back = config().catch_up_after + 1;
    let asked = start(&mut node, back, "p");
    assert!(
        fetches_from(&asked, 2) && !asked.iter().any(|o| matches!(o, Output::Push { .. })),
        "{asked:?}"
    );
}

fn probes_asked(asked: &[Output<u32, &'static str>]) -> Option<usize> {
    asked.iter().find_map(|o| match o {
        Output::Search { probes, .. } => Some(*probes),
        _ => None,
    })
}

#[test]
fn a_search_probes_while_the_view_is_small_after_the_first_search() {
    let mut node = Node::new(1, 10, config());
    let (probes, below) = (config().probes, config().probe_below);
    assert_eq!((probes, below), (3, 3));
    // Peers ranked above the node: it stays its own hub and searches in every warm-up round.
    let peers = |from: u32, to: u32| -> Vec<SeenHeader<u32>> {
        (from..to)
            .map(|p| SeenHeader {
                peer: p,
                rank: 1_000 + u64::from(p),
                cosine: 0.9,
                hub: p,
                hub_rank: 1_000 + u64::from(p),
            })
            .collect()
    };
    let round = |node: &mut Node, round: u64, found: Vec<SeenHeader<u32>>| {
        let t = Millis(round * 1_000);
        let asked = probes_asked(&start(node, round, "p"));
        node.handle(
            t.saturating_add(1),
            Input::SearchDone {
                round,
                headers: found,
            },
        );
        node.handle_timeout(t.saturating_add(1_000));
        assert!(finished(&drain(node)).is_some());
        asked
    };
    // Round 0: the first search does not probe, knowing nobody; it finds 2 peers.
    assert_eq!(round(&mut node, 0, peers(100, 102)), Some(0));
    // Round 1: a view of 2 probes, and finds 4 more peers.
    assert_eq!(round(&mut node, 1, peers(102, 106)), Some(probes));
    assert!(node.cohort().len() >= below);
    // Round 2: a larger view searches its band keys only.
    assert_eq!(round(&mut node, 2, Vec::new()), Some(0));
    // After the warm-up a hub searches every `search_every` rounds with `search_probes` probes:
    // two cohorts of one task whose band keys differ in a bit each meet only that way.
    for r in 3..10 {
        assert_eq!(round(&mut node, r, Vec::new()), None, "round {r}");
    }
    assert_eq!(
        round(&mut node, 10, Vec::new()),
        Some(config().search_probes)
    );
    assert_eq!(config().search_probes, 1);
}

#[test]
fn a_node_that_found_nobody_announces_before_it_probes() {
    // Not a hub candidate: while cohorts form it would only look up.
    let rank = u64::MAX - 5;
    assert!(!crate::is_hub_candidate(rank, config().candidates));
    assert_eq!(config().candidate_rounds, 2);
    let mut node = Node::new(1, rank, config());
    let search = |node: &mut Node, round: u64| {
        let asked = start(node, round, "p");
        let t = Millis(round * 1_000);
        node.handle(
            t.saturating_add(1),
            Input::SearchDone {
                round,
                headers: Vec::new(),
            },
        );
        node.handle_timeout(t.saturating_add(1_000));
        assert!(finished(&drain(node)).is_some());
        asked.iter().find_map(|o| match o {
            Output::Search {
                announce, probes, ..
            } => Some((*announce, *probes)),
            _ => None,
        })
    };
    // Round 0: looks up only, and finds nobody.
    assert_eq!(search(&mut node, 0), Some((false, 0)));
    // Round 1: no candidate of its task announced where it looked; it announces, so its
    // task's other nodes meet it, and looks up its band keys only.
    assert_eq!(search(&mut node, 1), Some((true, 0)));
    // Round 2: still nobody; every node announces now, and it probes.
    assert_eq!(search(&mut node, 2), Some((true, config().probes)));
}

/// Bounded hubs of fan-in `m`, the rounds counted from 0 (round 5 is past the warm-up's
/// searches).
fn tree(m: usize) -> ExchangeConfig {
    ExchangeConfig {
        fanout: Some(m),
        ..config()
    }
}

/// A node of a tree of fan-in `m` that is a member of hub 1 already.
fn member_of_1(own: u32, rank: u64, m: usize) -> Node {
    let mut node = Node::new(own, rank, tree(m)).with_first_round(0);
    node.view.learn([(1, 10)]);
    node.joined = Some(1);
    node
}

/// The push `out` holds to `to`: its packet and the hub that named `to`.
fn pushed(out: &[Output<u32, &'static str>], to: u32) -> Option<(&'static str, Option<u32>)> {
    out.iter().find_map(|o| match o {
        Output::Push {
            to: t, packet, via, ..
        } if *t == to => Some((*packet, *via)),
        _ => None,
    })
}

/// `from`'s push of the round `now` is in, with the hub that named `node`, delivered at `now`.
fn deliver_push(
    node: &mut Node,
    now: u64,
    from: (u32, u64),
    packet: &'static str,
    via: Option<u32>,
) {
    node.handle(
        Millis(now),
        Input::PushReceived {
            from: from.0,
            rank: from.1,
            round: now / 1_000,
            packet,
            cosine: 0.99,
            known: Vec::new(),
            via,
        },
    );
}

/// The answer `out` gives `to`.
fn answered(out: &[Output<u32, &'static str>], to: u32) -> Option<Answer<u32>> {
    out.iter().find_map(|o| match o {
        Output::Answer { to: t, answer, .. } if *t == to => Some(answer.clone()),
        _ => None,
    })
}

/// `from`'s push of the round `now` is delivered at `now`; the node's answer to it.
fn answer_to_push(
    node: &mut Node,
    now: u64,
    from: (u32, u64),
    packet: &'static str,
    via: Option<u32>,
) -> Option<Answer<u32>> {
    deliver_push(node, now, from, packet, via);
    answered(&drain(node), from.0)
}

/// Compute the merge `node` asks for in `out` as `merge`; returns whether it was a sub-hub's.
fn compute_merge(
    node: &mut Node,
    now: u64,
    out: &[Output<u32, &'static str>],
    merge: &'static str,
) -> bool {
    let Some((ticket, up)) = out.iter().find_map(|o| match o {
        Output::Merge { ticket, up, .. } => Some((*ticket, *up)),
        _ => None,
    }) else {
        panic!("no merge asked in {out:?}");
    };
    node.handle(
        Millis(now),
        Input::MergeComputed {
            ticket,
            merge: Some(merge),
        },
    );
    up
}

/// Pass every merge check `out` asks for.
fn pass_checks(node: &mut Node, now: u64, out: &[Output<u32, &'static str>]) {
    for o in out {
        if let Output::CheckMerge { ticket, .. } = o {
            node.handle(
                Millis(now),
                Input::MergeChecked {
                    ticket: *ticket,
                    verdict: MergeVerdict::Pass,
                },
            );
        }
    }
}

#[test]
fn a_full_hub_names_a_member_that_merges_its_child_and_passes_the_hubs_merge_down() {
    // A root searches every other round; this one is past its searches by round 5 (the test
    // is about its answers, not its schedule).
    let quiet = ExchangeConfig {
        tree_search_every: 10,
        ..tree(1)
    };
    let mut hub = Node::new(1, 10, quiet).with_first_round(0);
    hub.view.learn([(2, 20), (3, 30)]);
    let mut sub = member_of_1(2, 20, 1);
    let mut leaf = member_of_1(3, 30, 1);
    assert!(start(&mut hub, 5, "p1").is_empty());
    assert_eq!(pushed(&start(&mut sub, 5, "p2"), 1), Some(("p2", None)));
    assert_eq!(pushed(&start(&mut leaf, 5, "p3"), 1), Some(("p3", None)));

    // The hub admits one push; the next pusher is named the member it holds.
    deliver_push(&mut hub, 5_010, (2, 20), "p2", None);
    deliver_push(&mut hub, 5_011, (3, 30), "p3", None);
    let out = drain(&mut hub);
    assert_eq!(answered(&out, 2), Some(Answer::Accepted { depth: 0 }));
    assert_eq!(answered(&out, 3), Some(Answer::Full { hint: 2, rank: 20 }));
    answer(&mut sub, 5_020, 1, 5, Answer::Accepted { depth: 0 });
    answer(&mut leaf, 5_020, 1, 5, Answer::Full { hint: 2, rank: 20 });
    // The leaf pushes to that member, naming the hub that sent it: the member takes it as
    // its child, one level below the hub.
    assert_eq!(pushed(&drain(&mut leaf), 2), Some(("p3", Some(1))));
    deliver_push(&mut sub, 5_030, (3, 30), "p3", Some(1));
    assert_eq!(
        answered(&drain(&mut sub), 3),
        Some(Answer::Accepted { depth: 1 })
    );
    answer(&mut leaf, 5_040, 2, 5, Answer::Accepted { depth: 1 });

    // Its level closes before the hub's (500 against 600 thousandths): it merges its child
    // with its own packet and pushes that in place of its packet.
    assert_eq!(sub.poll_timeout(), Some(Millis(5_500)));
    sub.handle_timeout(Millis(5_500));
    let out = drain(&mut sub);
    assert!(compute_merge(&mut sub, 5_510, &out, "s2"));
    assert_eq!(pushed(&drain(&mut sub), 1), Some(("s2", None)));
    deliver_push(&mut hub, 5_520, (2, 20), "s2", None);
    assert_eq!(
        answered(&drain(&mut hub), 2),
        Some(Answer::Accepted { depth: 0 })
    );

    // The hub merges what it holds: the member's merge.
    hub.handle_timeout(Millis(5_600));
    let out = drain(&mut hub);
    let members = out.iter().find_map(|o| match o {
        Output::Merge { members, .. } => Some(members.clone()),
        _ => None,
    });
    assert_eq!(members, Some(vec![(2, "s2")]));
    assert!(!compute_merge(&mut hub, 5_610, &out, "m1"));
    let out = drain(&mut hub);
    pass_checks(&mut hub, 5_620, &out);
    let out = drain(&mut hub);
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::ServeMerge { merge: "m1", .. }))
    );

    // The member checks it, applies it and serves it to its child, which applies it too.
    sub.handle(
        Millis(5_630),
        Input::MergeReceived {
            from: 1,
            round: 5,
            merge: "m1",
            cosine: 0.99,
            lineage: sub.lineage(),
            listed: Vec::new(),
        },
    );
    let out = drain(&mut sub);
    pass_checks(&mut sub, 5_640, &out);
    let out = drain(&mut sub);
    assert!(out.iter().any(|o| matches!(
        o,
        Output::ServeMerge { to, merge: "m1", .. } if to.iter().any(|r| r.peer == 3)
    )));
    let report = finished(&out).unwrap();
    assert_eq!(
        (report.hub, report.apply),
        (
            1,
            Apply::Merge {
                merge: "m1",
                adopt: None
            }
        )
    );
    leaf.handle(
        Millis(5_650),
        Input::MergeReceived {
            from: 2,
            round: 5,
            merge: "m1",
            cosine: 0.99,
            lineage: leaf.lineage(),
            listed: vec![(1, 10), (2, 20)],
        },
    );
    let out = drain(&mut leaf);
    pass_checks(&mut leaf, 5_660, &out);
    let report = finished(&drain(&mut leaf)).unwrap();
    assert_eq!(
        (report.hub, report.apply),
        (
            2,
            Apply::Merge {
                merge: "m1",
                adopt: None
            }
        )
    );

    // Next round the leaf pushes to its member again (not to the hub, its lowest rank). The
    // hub keeps the member's place: a newcomer that pushes first is named the member.
    assert_eq!(pushed(&start(&mut leaf, 6, "q3"), 2), Some(("q3", None)));
    assert!(start(&mut hub, 6, "q1").is_empty());
    deliver_push(&mut hub, 6_005, (4, 40), "q4", None);
    assert_eq!(
        answered(&drain(&mut hub), 4),
        Some(Answer::Full { hint: 2, rank: 20 })
    );
    assert_eq!(pushed(&start(&mut sub, 6, "q2"), 1), Some(("q2", None)));
    deliver_push(&mut hub, 6_010, (2, 20), "q2", None);
    assert_eq!(
        answered(&drain(&mut hub), 2),
        Some(Answer::Accepted { depth: 0 })
    );
    deliver_push(&mut sub, 6_010, (3, 30), "q3", None);
    sub.handle_timeout(Millis(6_500));
    let out = drain(&mut sub);
    assert!(compute_merge(&mut sub, 6_510, &out, "s2'"));
    assert_eq!(pushed(&drain(&mut sub), 1), Some(("s2'", None)));
}

#[test]
fn a_member_whose_hub_serves_nothing_serves_its_childrens_merge_down() {
    let mut sub = member_of_1(2, 20, 4);
    assert_eq!(pushed(&start(&mut sub, 5, "p2"), 1), Some(("p2", None)));
    answer(&mut sub, 5_020, 1, 5, Answer::Accepted { depth: 0 });
    deliver_push(&mut sub, 5_030, (3, 30), "p3", None);
    sub.handle_timeout(Millis(5_500));
    let out = drain(&mut sub);
    assert!(compute_merge(&mut sub, 5_510, &out, "s2"));
    assert_eq!(pushed(&drain(&mut sub), 1), Some(("s2", None)));
    // The hub answers late (its admission closed) and never serves: at the deadline the
    // member serves its children's merge (they check it), and applies its own update.
    answer(&mut sub, 5_700, 1, 5, Answer::Late);
    sub.handle_timeout(Millis(6_000));
    let out = drain(&mut sub);
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::ServeMerge { merge: "s2", .. }))
    );
    let report = finished(&out).unwrap();
    assert_eq!(report.apply, Apply::Own("p2"));
    assert!(report.missed);
}

#[test]
fn a_member_joining_a_new_hub_names_it_to_pushers_unless_that_hub_sent_them() {
    let mut node = Node::new(2, 20, tree(4)).with_first_round(0);
    node.view.learn([(1, 10)]);
    let out = start(&mut node, 5, "p2");
    let ticket = fetch_ticket(&out, 1);
    // A pusher its hub did not send is told to push to that hub itself (and take its model);
    // one that hub sent is its child.
    deliver_push(&mut node, 5_010, (3, 30), "p3", None);
    deliver_push(&mut node, 5_011, (4, 40), "p4", Some(1));
    let out = drain(&mut node);
    assert_eq!(answered(&out, 4), Some(Answer::Accepted { depth: 1 }));
    check_model(&mut node, Millis(5_020), ticket, "m1", ModelVerdict::Adopt);
    let out = drain(&mut node);
    assert_eq!(answered(&out, 3), Some(Answer::NotHub { hub: 1, rank: 10 }));
    assert_eq!(answered(&out, 4), None);
}

/// A round of a node that is its own hub whose search (if it asks for one) finds `found`.
fn root_round(node: &mut Node, round: u64, found: &[(u32, u64)]) -> bool {
    let asked = start(node, round, "p");
    let t = Millis(round * 1_000);
    if searches(&asked) {
        let headers = found
            .iter()
            .map(|&(peer, rank)| SeenHeader {
                peer,
                rank,
                cosine: 0.99,
                hub: peer,
                hub_rank: rank,
            })
            .collect();
        node.handle(t.saturating_add(1), Input::SearchDone { round, headers });
    }
    drain(node);
    node.handle_timeout(t.saturating_add(1_000));
    assert!(finished(&drain(node)).is_some(), "round {round} ends");
    searches(&asked)
}

#[test]
fn a_trees_root_searches_every_tree_search_every_rounds() {
    // It never pushes to its next rank when idle (the peer it knows would not answer, and a
    // node that lost every peer searches in the next round).
    let cfg = ExchangeConfig {
        idle_rounds: u32::MAX,
        ..tree(64)
    };
    let every = cfg.tree_search_every;
    assert_eq!((cfg.warmup_searches, every, cfg.search_every), (3, 2, 10));
    let mut node = Node::new(1, 10, cfg);
    // Alone, it is its own hub (a root); its first search finds a peer it outranks (a node
    // that knows nobody searches at window ends too). The warm-up's searches, then one every
    // 2 rounds, where one hub per cohort waits `search_every`.
    let rounds: Vec<bool> = (0..12)
        .map(|r| root_round(&mut node, r, if r == 0 { &[(100, 1_000)] } else { &[] }))
        .collect();
    let expected: Vec<bool> = (0..12u64)
        .map(|x| x < 3 || x.is_multiple_of(every))
        .collect();
    assert_eq!(rounds, expected);
}

#[test]
fn a_root_searches_again_while_its_searches_teach_it_peers() {
    // Rank 1: it stays its own hub whatever it finds.
    let mut node = Node::new(1, 1, config());
    for round in 0..3 {
        assert!(root_round(&mut node, round, &[(10 + round as u32, 50)]));
    }
    // After the warm-up its search of round 2 taught it a peer: it searches in round 3 too,
    // which teaches it nothing new, and then keeps to its schedule.
    assert!(root_round(&mut node, 3, &[(12, 50)]));
    assert!(!root_round(&mut node, 4, &[]));
    assert!(!root_round(&mut node, 5, &[]));
}

#[test]
fn a_member_never_takes_its_own_hub_as_its_child() {
    let mut sub = member_of_1(2, 20, 4);
    assert_eq!(pushed(&start(&mut sub, 5, "p2"), 1), Some(("p2", None)));
    answer(&mut sub, 5_020, 1, 5, Answer::Accepted { depth: 0 });
    // A child pushes and is held...
    deliver_push(&mut sub, 5_030, (3, 30), "p3", None);
    assert_eq!(
        answered(&drain(&mut sub), 3),
        Some(Answer::Accepted { depth: 1 })
    );
    // ...its own hub is not (a tree's hub can name a root that joined it to that root's old
    // child, and the two would merge only each other's pushes).
    deliver_push(&mut sub, 5_040, (1, 10), "p1", None);
    let answer = answered(&drain(&mut sub), 1);
    assert!(
        !matches!(answer, Some(Answer::Accepted { .. }) | None),
        "{answer:?}"
    );
}

#[test]
fn a_tree_member_its_parent_answers_busy_leaves_it_within_the_round() {
    // Node 3 sticks to its parent 2, while its view still holds 1 (its root, gone). The
    // parent dropped 1 too, and now pushes to 3, which outranks it: it answers 3's push busy.
    let mut node = Node::new(3, 15, tree(4)).with_first_round(0);
    node.view.learn([(1, 10), (2, 20)]);
    node.joined = Some(2);
    assert!(pushed(&start(&mut node, 5, "p3"), 2).is_some());
    answer(&mut node, 5_010, 2, 5, Answer::Busy);
    // It leaves the parent and chooses again: its view's hub first, whose model does not
    // come (gone)...
    let out = drain(&mut node);
    assert!(finished(&out).is_none(), "{out:?}");
    let ticket = fetch_ticket(&out, 1);
    model_lost(&mut node, 5_020, ticket);
    // ...then itself: it heads, and takes its old parent's push.
    assert!(!fetches_from(&drain(&mut node), 2));
    assert_eq!(
        answer_to_push(&mut node, 5_030, (2, 20), "p2", None),
        Some(Answer::Accepted { depth: 0 })
    );
}

#[test]
fn a_tree_member_whose_parent_is_gone_takes_its_next_rank_within_the_round() {
    let cfg = ExchangeConfig {
        timing: Timing {
            answer_ms: 100,
            ..Timing::default()
        },
        ..tree(4)
    };
    let mut node = Node::new(3, 30, cfg).with_first_round(0);
    node.view.learn([(1, 10), (2, 20)]);
    node.joined = Some(2);
    assert!(pushed(&start(&mut node, 5, "p3"), 2).is_some());
    // No answer to the push nor to its retry: the parent is gone, and the member joins its
    // root (its model first) in the same round rather than losing it.
    node.handle_timeout(Millis(5_100));
    assert!(pushed(&drain(&mut node), 2).is_some());
    node.handle_timeout(Millis(5_200));
    let out = drain(&mut node);
    assert!(finished(&out).is_none(), "{out:?}");
    assert!(fetches_from(&out, 1));
}

#[test]
fn a_node_joining_a_hub_in_a_tree_names_a_held_pusher_once_it_holds_its_fanout() {
    let mut node = Node::new(2, 20, tree(1)).with_first_round(0);
    node.view.learn([(1, 10)]);
    let out = start(&mut node, 5, "p2");
    let _ticket = fetch_ticket(&out, 1);
    assert_eq!(
        answer_to_push(&mut node, 5_010, (3, 30), "p3", None),
        Some(Answer::Accepted { depth: 0 })
    );
    // Its fan-out is held: the next pusher is sent to the held one, not refused busy.
    assert_eq!(
        answer_to_push(&mut node, 5_011, (4, 40), "p4", None),
        Some(Answer::Full { hint: 3, rank: 30 })
    );
}

#[test]
fn an_idle_root_its_next_rank_does_not_take_heads_its_tree_that_round() {
    // Past its searches (the test is about its answers, not its schedule).
    let quiet = ExchangeConfig {
        tree_search_every: 10,
        ..tree(4)
    };
    let mut node = Node::new(1, 10, quiet).with_first_round(0);
    node.view.learn([(2, 20)]);
    node.idle = node.config.idle_rounds;
    // Nobody pushed to it: it joins its next rank, which is busy (it pushes to this node: its
    // own hub left).
    let ticket = fetch_ticket(&start(&mut node, 5, "p1"), 2);
    check_model(&mut node, Millis(5_005), ticket, "m2", ModelVerdict::Keep);
    assert!(pushed(&drain(&mut node), 2).is_some());
    answer(&mut node, 5_010, 2, 5, Answer::Busy);
    assert!(finished(&drain(&mut node)).is_none());
    // It heads for the rest of the round, and the pushes of the task that comes to it count.
    assert_eq!(
        answer_to_push(&mut node, 5_020, (2, 20), "p2", None),
        Some(Answer::Accepted { depth: 0 })
    );
}

#[test]
fn a_member_that_heads_within_the_round_tells_its_children_their_new_depth() {
    // Node 3 is a child of 2, which is a child of 1 (gone); it holds a child of its own.
    let mut node = Node::new(3, 15, tree(4)).with_first_round(0);
    node.view.learn([(1, 10), (2, 20)]);
    node.joined = Some(2);
    assert!(pushed(&start(&mut node, 5, "p3"), 2).is_some());
    answer(&mut node, 5_010, 2, 5, Answer::Accepted { depth: 1 });
    assert_eq!(
        answer_to_push(&mut node, 5_020, (4, 40), "p4", Some(2)),
        Some(Answer::Accepted { depth: 2 })
    );
    // Its parent lost its root and names this node, which outranks it; the root's model does
    // not come: the node heads, and its child is one level below it now.
    answer(&mut node, 5_030, 2, 5, Answer::NotHub { hub: 3, rank: 15 });
    let ticket = fetch_ticket(&drain(&mut node), 1);
    model_lost(&mut node, 5_040, ticket);
    assert_eq!(
        answered(&drain(&mut node), 4),
        Some(Answer::Accepted { depth: 0 })
    );
}

/// Round `round` of member `node`: its hub `hub` accepts its push and serves `merge` of
/// `lineage`, which passes the member's checks. The outputs before the merge came, and the
/// round's report.
fn merged_round(
    node: &mut Node,
    round: u64,
    hub: u32,
    merge: &'static str,
    lineage: u64,
) -> (
    Vec<Output<u32, &'static str>>,
    RoundReport<u32, &'static str>,
) {
    let t = round * 1_000;
    let before = start(node, round, "own");
    answer(node, t + 10, hub, round, Answer::Accepted { depth: 0 });
    (
        before,
        merge_passes(node, t + 500, hub, round, merge, lineage),
    )
}

/// Hub `hub` serves `merge` of `lineage` for `round` at `now`; it passes the member's checks.
/// The round's report.
fn merge_passes(
    node: &mut Node,
    now: u64,
    hub: u32,
    round: u64,
    merge: &'static str,
    lineage: u64,
) -> RoundReport<u32, &'static str> {
    node.handle(
        Millis(now),
        Input::MergeReceived {
            from: hub,
            round,
            merge,
            cosine: 0.97,
            lineage,
            listed: Vec::new(),
        },
    );
    let Some(Output::CheckMerge { ticket, .. }) = node.poll_output() else {
        panic!("the merge is checked");
    };
    node.handle(
        Millis(now + 10),
        Input::MergeChecked {
            ticket,
            verdict: MergeVerdict::Pass,
        },
    );
    finished(&drain(node)).expect("the round ends with the merge")
}

#[test]
fn a_member_handed_another_lineages_merge_takes_its_hubs_model_next_round() {
    let mut member = Node::new(2, 20, config());
    member.view.learn([(1, 10)]);
    member.joined = Some(1);
    let hub_lineage = member.lineage() ^ 1;
    // Round 0: a member of hub 1 already, it pushes at once and applies the merge, of a
    // lineage that is not its model's.
    let (before, report) = merged_round(&mut member, 0, 1, "m0", hub_lineage);
    assert!(pushes_to(&before, 1), "{before:?}");
    assert_eq!(
        report.apply,
        Apply::Merge {
            merge: "m0",
            adopt: None
        }
    );
    assert_ne!(member.lineage(), hub_lineage);
    // Round 1: it fetches its hub's model before it pushes, as when it joined.
    let out = start(&mut member, 1, "own");
    let Some(&Output::FetchModel { ticket, hub: 1 }) = out.first() else {
        panic!("{out:?}");
    };
    member.handle(
        Millis(1_050),
        Input::ModelReceived {
            ticket,
            model: Some("hub model"),
        },
    );
    let Some(Output::CheckModel { ticket, .. }) = member.poll_output() else {
        panic!("the model is checked on the member's data");
    };
    // Its data accepts the model, though far from its own: it takes it all the same (the
    // model of the merges it applies).
    member.handle(
        Millis(1_060),
        Input::ModelChecked {
            ticket,
            verdict: ModelVerdict::Keep,
        },
    );
    assert!(matches!(
        drain(&mut member).as_slice(),
        [Output::Push { to: 1, .. }]
    ));
    answer(&mut member, 1_070, 1, 1, Answer::Accepted { depth: 0 });
    assert_eq!(
        merge_passes(&mut member, 1_500, 1, 1, "m1", hub_lineage).apply,
        Apply::Merge {
            merge: "m1",
            adopt: Some("hub model")
        }
    );
    assert_eq!(member.lineage(), hub_lineage);
    // Round 2: one lineage with its hub: it pushes at once again.
    let (before, _) = merged_round(&mut member, 2, 1, "m2", hub_lineage);
    assert!(pushes_to(&before, 1), "{before:?}");
    assert_eq!(member.lineage(), hub_lineage);
}

#[test]
fn a_node_that_applies_its_own_update_takes_a_fresh_lineage_and_a_hub_serves_its_own() {
    // No data check of the hub's own merge (round 1 would have one).
    let cfg = ExchangeConfig {
        data_checks_from: 5,
        ..config()
    };
    let mut hub = Node::new(1, 10, cfg);
    let first = hub.lineage();
    // Round 0: nobody pushes; it applies its own update.
    start(&mut hub, 0, "p0");
    hub.handle(
        Millis(5),
        Input::SearchDone {
            round: 0,
            headers: Vec::new(),
        },
    );
    hub.handle_timeout(Millis(600));
    assert_eq!(finished(&drain(&mut hub)).unwrap().apply, Apply::Own("p0"));
    let own = hub.lineage();
    assert_ne!(own, first);
    // Round 1: a member's push; the hub serves its merge with its lineage, which its own
    // merge does not change.
    start(&mut hub, 1, "p1");
    hub.handle(
        Millis(1_001),
        Input::PushReceived {
            from: 2,
            rank: 20,
            round: 1,
            packet: "p2",
            cosine: 0.97,
            known: Vec::new(),
            via: None,
        },
    );
    hub.handle_timeout(Millis(1_600));
    let ticket = drain(&mut hub)
        .into_iter()
        .find_map(|o| match o {
            Output::Merge { ticket, .. } => Some(ticket),
            _ => None,
        })
        .expect("the hub merges");
    hub.handle(
        Millis(1_650),
        Input::MergeComputed {
            ticket,
            merge: Some("m"),
        },
    );
    let out = drain(&mut hub);
    let served = out.iter().find_map(|o| match o {
        Output::ServeMerge { lineage, .. } => Some(*lineage),
        _ => None,
    });
    assert_eq!(served, Some(own));
    assert!(matches!(
        finished(&out).unwrap().apply,
        Apply::Merge { merge: "m", .. }
    ));
    assert_eq!(hub.lineage(), own);
}

#[test]
fn a_sub_hub_that_takes_its_hubs_model_again_keeps_its_children() {
    let mut sub = member_of_1(3, 30, 4);
    let hub_lineage = sub.lineage() ^ 1;
    // Round 0: the merge it applies is of another lineage.
    let (_, report) = merged_round(&mut sub, 0, 1, "m0", hub_lineage);
    assert!(matches!(report.apply, Apply::Merge { adopt: None, .. }));
    // Round 1: it fetches hub 1's model; its child pushes meanwhile and is held as its child.
    let out = start(&mut sub, 1, "own");
    let Some(&Output::FetchModel { ticket, hub: 1 }) = out.first() else {
        panic!("{out:?}");
    };
    assert_eq!(
        answer_to_push(&mut sub, 1_020, (4, 40), "p4", None),
        Some(Answer::Accepted { depth: 1 })
    );
    sub.handle(
        Millis(1_050),
        Input::ModelReceived {
            ticket,
            model: Some("hub model"),
        },
    );
    let Some(Output::CheckModel { ticket, .. }) = sub.poll_output() else {
        panic!("the model is checked");
    };
    sub.handle(
        Millis(1_060),
        Input::ModelChecked {
            ticket,
            verdict: ModelVerdict::Adopt,
        },
    );
    // Its packet goes up; its child is not sent to hub 1.
    let out = drain(&mut sub);
    assert_eq!(pushed(&out, 1), Some(("own", None)));
    assert_eq!(answered(&out, 4), None);
    answer(&mut sub, 1_070, 1, 1, Answer::Accepted { depth: 0 });
    // Its level closes: it merges its child with its own packet and pushes that up.
    let close = sub.poll_timeout().expect("its level closes");
    sub.handle_timeout(close);
    let out = drain(&mut sub);
    assert!(compute_merge(&mut sub, close.0 + 5, &out, "s1"));
    assert_eq!(pushed(&drain(&mut sub), 1), Some(("s1", None)));
}

/// A search finds peer 2 (rank 5) at sketch cosine 0.3, under the gate's floor.
fn found_far(node: &mut Node, round: u64) {
    let headers = vec![SeenHeader {
        peer: 2,
        rank: 5,
        cosine: 0.3,
        hub: 2,
        hub_rank: 5,
    }];
    node.handle(
        Millis(round * 1_000 + 1),
        Input::SearchDone { round, headers },
    );
}

#[test]
fn a_stranded_node_learns_peers_under_the_gate_and_takes_a_far_model_its_data_accepts() {
    let c = config();
    assert_eq!(c.stranded_after, 3);
    // Not stranded yet: a search result under the gate's floor is not learned.
    let mut fresh = Node::new(1, 10, c.clone());
    assert!(searches(&start(&mut fresh, 0, "p")));
    found_far(&mut fresh, 0);
    assert!(fresh.cohort().is_empty());
    // Alone in exchange rounds 0-3 (searches find nobody), it searches in round 4 (a node
    // that knows nobody) and learns the far peer.
    let mut node = Node::new(1, 10, c);
    for round in 0..4 {
        assert_eq!(idle_round(&mut node, round).1.role, Role::Hub);
    }
    let out = start(&mut node, 4, "p");
    assert!(searches(&out));
    found_far(&mut node, 4);
    assert_eq!(node.hub(), 2);
    let out = drain(&mut node);
    let ticket = fetch_ticket(&out, 2);
    // Its data accepts the hub's model, far from its own: it takes it all the same, so the
    // hub's gate, which refuses its drifted packet, lets its next one in.
    check_model(&mut node, Millis(4_010), ticket, "m2", ModelVerdict::Keep);
    assert!(pushes_to(&drain(&mut node), 2));
    answer(&mut node, 4_600, 2, 4, Answer::Refused { foreign: false });
    let report = finished(&drain(&mut node)).unwrap();
    assert_eq!(report.apply, Apply::Adopt("m2"));
    assert_eq!(node.joined(), Some(&2));
    // Next round it pushes to its hub as a member.
    let out = start(&mut node, 5, "p5");
    assert!(pushes_to(&out, 2), "{out:?}");
}

/// Round `round` of a hub that `pushers` push to (at sketch cosine 0.99), every merge made and
/// every check passed.
fn hub_round(
    node: &mut Node,
    round: u64,
    pushers: &[(u32, u64)],
) -> RoundReport<u32, &'static str> {
    let t = round * 1_000;
    node.handle(
        Millis(t),
        Input::RoundStart {
            round,
            deadline: Millis(t + 1_000),
        },
    );
    for &(from, rank) in pushers {
        node.handle(
            Millis(t + 1),
            Input::PushReceived {
                from,
                rank,
                round,
                packet: "p",
                cosine: 0.99,
                known: Vec::new(),
                via: None,
            },
        );
    }
    node.handle(
        Millis(t + 2),
        Input::PacketReady {
            round,
            packet: "p1",
        },
    );
    let mut out = drain(node);
    if searches(&out) {
        let headers = Vec::new();
        node.handle(Millis(t + 3), Input::SearchDone { round, headers });
        out.extend(drain(node));
    }
    node.handle_timeout(Millis(t + 600));
    let mut pending = drain(node);
    while !pending.is_empty() {
        for o in &pending {
            match o {
                Output::Merge { ticket, .. } => {
                    let merge = Some("merge");
                    node.handle(
                        Millis(t + 650),
                        Input::MergeComputed {
                            ticket: *ticket,
                            merge,
                        },
                    );
                }
                Output::CheckMerge { ticket, .. } => {
                    let verdict = MergeVerdict::Pass;
                    node.handle(
                        Millis(t + 700),
                        Input::MergeChecked {
                            ticket: *ticket,
                            verdict,
                        },
                    );
                }
                _ => {}
            }
        }
        out.append(&mut pending);
        pending = drain(node);
    }
    node.handle_timeout(Millis(t + 1_000));
    out.extend(drain(node));
    finished(&out).unwrap()
}

#[test]
fn a_hub_of_a_pair_is_stranded_and_a_hub_of_three_is_not() {
    for (pushers, learns) in [(&[(3, 30)][..], true), (&[(3, 30), (4, 40)][..], false)] {
        let mut hub = Node::new(1, 10, config());
        // Exchange rounds 0-9 as the hub of `pushers`; it searches again in round 10.
        for round in 0..10 {
            let report = hub_round(&mut hub, round, pushers);
            assert_eq!(report.role, Role::Hub);
            assert_eq!(
                report.apply,
                Apply::Merge {
                    merge: "merge",
                    adopt: None
                }
            );
        }
        assert!(searches(&start(&mut hub, 10, "p1")));
        found_far(&mut hub, 10);
        assert_eq!(hub.hub() == 2, learns, "pushers {pushers:?}");
    }
}
