//! Pipeline compositions (issue 16): a pipeline head names the stage processes that serve its
//! layer ranges, with a compare-and-set on its record's epoch; every composition gets a new
//! pipeline epoch, unique in the log. Stages read the record and serve only work stamped with
//! the current epoch of a composition that names them, so a stage the head spliced out cannot
//! take part again, whatever it missed while it was paused or cut off.

use std::collections::HashSet;

use super::{check_lease_ms, check_len, reject, LogState};
use crate::limits::*;
use crate::types::*;

impl LogState {
    pub(super) fn set_pipeline(
        &mut self,
        head: &str,
        expect_epoch: u64,
        stages: &[PipelineStage],
    ) -> Result<Pipeline, Rejection> {
        check_len("decoder id bytes", head.len(), DECODER_ID_BYTES_MAX)?;
        check_len("pipeline stages", stages.len(), PIPELINE_STAGES_MAX)?;
        if head.is_empty() || stages.is_empty() {
            return Err(reject(
                RejectReason::Invalid,
                "a pipeline names its head and at least one stage",
            ));
        }
        let mut next_layer = 0;
        let mut ids = HashSet::with_capacity(stages.len());
        for (i, s) in stages.iter().enumerate() {
            check_len("stage id bytes", s.stage_id.len(), STAGE_ID_BYTES_MAX)?;
            check_len("stage address bytes", s.addr.len(), STAGE_ADDR_BYTES_MAX)?;
            if s.stage_id.is_empty() || !ids.insert(s.stage_id.as_str()) {
                return Err(reject(
                    RejectReason::Invalid,
                    format!("stage {} has an empty name or one another stage has", i + 1),
                ));
            }
            if s.first_layer != next_layer || s.end_layer <= s.first_layer {
                return Err(reject(
                    RejectReason::Invalid,
                    format!(
                        "stage {} ({}) holds layers {}..{}: the pipeline needs a non-empty range from layer {next_layer}",
                        i + 1,
                        s.stage_id,
                        s.first_layer,
                        s.end_layer
                    ),
                ));
            }
            next_layer = s.end_layer;
        }
        let current = self.pipelines.get(head).map_or(0, |p| p.epoch);
        if current != expect_epoch {
            return Err(Rejection {
                current_epoch: current,
                ..reject(
                    RejectReason::PipelineConflict,
                    format!(
                        "the pipeline of head {head:?} is at epoch {current} (0: none), not {expect_epoch}: read it again"
                    ),
                )
            });
        }
        if current == 0 && self.pipelines.len() >= PIPELINES_MAX {
            // Only at the bound: records of heads whose registration lapsed before they ever
            // registered (a head that died between its composition and its registration).
            let gone: Vec<String> = self
                .pipelines
                .keys()
                .filter(|h| !self.decoders.contains_key(*h))
                .cloned()
                .collect();
            for h in gone {
                self.pipelines.remove(&h);
            }
            if self.pipelines.len() >= PIPELINES_MAX {
                return Err(reject(
                    RejectReason::Full,
                    format!("the log holds {PIPELINES_MAX} pipeline compositions"),
                ));
            }
        }
        self.next_pipeline_epoch += 1;
        let p = Pipeline {
            head: head.to_string(),
            epoch: self.next_pipeline_epoch,
            stages: stages.to_vec(),
            set_log_ms: self.log_ms,
        };
        self.pipelines.insert(head.to_string(), p.clone());
        Ok(p)
    }

    pub(super) fn register_stage(
        &mut self,
        stage_id: &str,
        info: &StageRegistration,
        ttl_ms: u64,
    ) -> Result<u64, Rejection> {
        check_lease_ms(ttl_ms)?;
        check_len("stage id bytes", stage_id.len(), STAGE_ID_BYTES_MAX)?;
        check_len("stage address bytes", info.addr.len(), STAGE_ADDR_BYTES_MAX)?;
        check_len("weights digest bytes", info.weights_sha256.len(), STAGE_ADDR_BYTES_MAX)?;
        if stage_id.is_empty() || info.addr.is_empty() || info.weights_sha256.is_empty() {
            return Err(reject(
                RejectReason::Invalid,
                "a stage registration names the stage, its address and its weights",
            ));
        }
        if info.end_layer < info.first_layer {
            return Err(reject(
                RejectReason::Invalid,
                format!(
                    "stage {stage_id:?} holds layers {}..{}: the range is reversed",
                    info.first_layer, info.end_layer
                ),
            ));
        }
        let old = self.stages.get(stage_id).map(|r| r.expiry_log_ms);
        if old.is_none() && self.stages.len() >= STAGES_MAX {
            return Err(reject(
                RejectReason::Full,
                format!("the log holds {STAGES_MAX} stage registrations"),
            ));
        }
        if let Some(t) = old {
            self.index.stage_expiry.remove(&(t, stage_id.to_string()));
        }
        let expiry_log_ms = self.log_ms + ttl_ms;
        self.index.stage_expiry.insert((expiry_log_ms, stage_id.to_string()));
        self.stages.insert(
            stage_id.to_string(),
            StageRegistration {
                expiry_log_ms,
                ..info.clone()
            },
        );
        Ok(expiry_log_ms)
    }
}
