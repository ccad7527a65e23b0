//! Pipeline compositions: compare-and-set on the head's epoch, epochs unique in the log, the
//! shape checked, the record dropped with the head's registration.

use super::*;

fn stage(id: &str, a: u32, b: u32) -> PipelineStage {
    PipelineStage {
        stage_id: id.into(),
        addr: format!("127.0.0.1:{}", 7000 + a),
        first_layer: a,
        end_layer: b,
    }
}

fn three() -> Vec<PipelineStage> {
    vec![stage("s1", 0, 10), stage("s2", 10, 20), stage("s3", 20, 30)]
}

impl T {
    fn set_pipeline(
        &mut self,
        t: u64,
        head: &str,
        expect: u64,
        stages: Vec<PipelineStage>,
    ) -> Result<Pipeline, Rejection> {
        match self.at(
            t,
            Command::SetPipeline {
                head: head.into(),
                expect_epoch: expect,
                stages,
            },
        ) {
            Response::Pipeline(r) => r,
            r => panic!("{r:?}"),
        }
    }
}

#[test]
fn a_composition_is_written_against_the_heads_current_epoch_only() {
    let mut t = T::new();
    let p = t.set_pipeline(10, "h1", 0, three()).expect("first composition");
    assert_eq!((p.epoch, p.set_log_ms), (1, 10));
    assert!(p.has_stage("s2", 10, 20) && !p.has_stage("s2", 10, 21) && !p.has_stage("s4", 10, 20));
    // Another head's epochs come from the same counter: an epoch names one composition.
    assert_eq!(t.set_pipeline(11, "h2", 0, three()).expect("h2").epoch, 2);
    // A splice: s2 replaced by its spare, against epoch 1.
    let mut spliced = three();
    spliced[1] = stage("s2-spare", 10, 20);
    let p2 = t.set_pipeline(20, "h1", 1, spliced.clone()).expect("splice");
    assert_eq!(p2.epoch, 3);
    assert!(!p2.has_stage("s2", 10, 20) && p2.has_stage("s2-spare", 10, 20));
    // A second write against the epoch it replaced (a head that did not see the first answer,
    // an old incarnation) changes nothing and says where the record is.
    let before = t.s.clone();
    for expect in [0, 1, 2, 4] {
        let r = t.set_pipeline(30, "h1", expect, three()).unwrap_err();
        assert_eq!(
            (r.reason, r.current_epoch),
            (RejectReason::PipelineConflict, 3),
            "expect {expect}"
        );
    }
    assert_eq!(t.s.pipelines, before.pipelines);
    assert_eq!(t.s.next_pipeline_epoch, before.next_pipeline_epoch);
    assert_eq!(t.s.pipelines["h1"].stages, spliced);
}

#[test]
fn a_composition_that_is_not_a_pipeline_of_layers_is_refused() {
    let mut t = T::new();
    let cases: Vec<(&str, Vec<PipelineStage>)> = vec![
        ("no stages", vec![]),
        ("a gap", vec![stage("a", 0, 10), stage("b", 11, 30)]),
        ("an overlap", vec![stage("a", 0, 10), stage("b", 9, 30)]),
        ("not from layer 0", vec![stage("a", 1, 10)]),
        ("an empty range", vec![stage("a", 0, 0)]),
        ("a name twice", vec![stage("a", 0, 10), stage("a", 10, 20)]),
        ("an empty name", vec![stage("", 0, 10)]),
    ];
    for (what, stages) in cases {
        let r = t.set_pipeline(10, "h", 0, stages).unwrap_err();
        assert_eq!(r.reason, RejectReason::Invalid, "{what}: {r:?}");
    }
    let r = t.set_pipeline(10, "", 0, three()).unwrap_err();
    assert_eq!(r.reason, RejectReason::Invalid);
    let many: Vec<PipelineStage> = (0..PIPELINE_STAGES_MAX as u32 + 1)
        .map(|i| stage(&format!("s{i}"), i, i + 1))
        .collect();
    assert_eq!(
        t.set_pipeline(10, "h", 0, many).unwrap_err().reason,
        RejectReason::Limit
    );
    let long = stage(&"x".repeat(STAGE_ID_BYTES_MAX + 1), 0, 30);
    assert_eq!(
        t.set_pipeline(10, "h", 0, vec![long]).unwrap_err().reason,
        RejectReason::Limit
    );
    assert!(
        t.s.pipelines.is_empty() && t.s.next_pipeline_epoch == 0,
        "nothing written"
    );
}

#[test]
fn a_heads_composition_goes_with_its_registration_and_epochs_never_repeat() {
    let mut t = T::new();
    let info = DecoderInfo {
        model_name: "m".into(),
        model: model(),
        capacity: 1,
        ..Default::default()
    };
    t.set_pipeline(0, "h1", 0, three()).expect("composition");
    t.at(
        1,
        Command::RegisterDecoder {
            decoder: "h1".into(),
            info,
            ttl_ms: 1_000,
        },
    );
    t.at(500, Command::Tick { retention_ms: 10_000 });
    assert!(t.s.pipelines.contains_key("h1"), "kept while the head is registered");
    t.at(1_001, Command::Tick { retention_ms: 10_000 });
    assert!(
        !t.s.pipelines.contains_key("h1"),
        "dropped with the head's registration"
    );
    // A head of that name again starts from no record, at an epoch no composition had.
    let p = t.set_pipeline(1_100, "h1", 0, three()).expect("again");
    assert_eq!(p.epoch, 2);
}

impl T {
    fn register_stage(&mut self, t: u64, id: &str, layers: (u32, u32), ttl_ms: u64) -> Result<u64, Rejection> {
        let info = StageRegistration {
            addr: format!("127.0.0.1:{}", 7100 + layers.0),
            weights_sha256: "w".into(),
            first_layer: layers.0,
            end_layer: layers.1,
            expiry_log_ms: 0,
        };
        match self.at(
            t,
            Command::RegisterStage {
                stage_id: id.into(),
                info,
                ttl_ms,
            },
        ) {
            Response::Registered(r) => r,
            r => panic!("{r:?}"),
        }
    }
}

/// A stage registration lives for its TTL from its latest renewal and is dropped by `Tick`
/// after it; a cold one (no layers yet) is one too; a bad one changes nothing.
#[test]
fn a_stage_registration_lapses_by_its_ttl_from_its_latest_renewal() {
    let mut t = T::new();
    assert_eq!(t.register_stage(100, "s2", (10, 20), 1_000), Ok(1_100));
    assert_eq!(t.register_stage(150, "cold", (0, 0), 1_000), Ok(1_150));
    assert!(t.s.stages["cold"].is_cold() && !t.s.stages["s2"].is_cold());
    // Renewed at 600: it now lapses at 1_600, not 1_100.
    assert_eq!(t.register_stage(600, "s2", (10, 20), 1_000), Ok(1_600));
    assert!(!t.s.tick_due(1_149, u64::MAX));
    assert!(t.s.tick_due(1_150, u64::MAX));
    t.at(1_200, Command::Tick { retention_ms: u64::MAX });
    assert_eq!(t.s.stages.keys().collect::<Vec<_>>(), ["s2"]);
    assert!(!t.s.tick_due(1_599, u64::MAX));
    t.at(1_600, Command::Tick { retention_ms: u64::MAX });
    assert!(t.s.stages.is_empty() && !t.s.tick_due(10_000, u64::MAX));
    // Refused, and nothing changes: a reversed range, no name, a TTL out of bounds.
    let before = t.s.clone();
    assert_eq!(
        reason(t.register_stage(1_700, "s", (20, 10), 1_000)),
        RejectReason::Invalid
    );
    assert_eq!(
        reason(t.register_stage(1_700, "", (0, 10), 1_000)),
        RejectReason::Invalid
    );
    assert_eq!(reason(t.register_stage(1_700, "s", (0, 10), 0)), RejectReason::Limit);
    let long = "x".repeat(STAGE_ID_BYTES_MAX + 1);
    assert_eq!(
        reason(t.register_stage(1_700, &long, (0, 10), 1_000)),
        RejectReason::Limit
    );
    assert_eq!((&t.s.stages, &t.s.index), (&before.stages, &before.index));
}
