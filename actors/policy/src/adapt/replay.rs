//! Recognising a restarted camera's repeated uploads, so each drift phase of each camera is
//! adapted once and counted once.
//!
//! A camera killed and started again streams from its first frame again: the same seeded
//! stream through the same cached student and the same detector, so it notices the same drifts
//! at the same frames and uploads them again as adaptations 0, 1, ... The edge remembers, per
//! camera, each drift phase it accepted (the camera's adaptation index and drift frame) and
//! whether that phase was answered; [`classify`] decides what a new upload of that camera is
//! from what the edge remembers of that camera alone (a camera speaks only for itself: the
//! edge charges an upload to the node that sent it before asking).
//!
//! The rules, in order: an index at or past the cap is refused (the edge's memory per camera is
//! bounded); the same index with the same drift frame is a repeat (wait for the adaptation
//! under way, or send its answer again); the same index with another drift frame, or a drift
//! frame out of stream order with the camera's other phases, is refused as a conflicting
//! claim; anything else is a fresh phase to adapt.

/// One drift phase of one camera, as its upload names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Phase {
    /// The camera's adaptation index (0 for its first drift, 1 for the next, ...).
    pub adaptation: u32,
    /// The frame at which the camera noticed the drift.
    pub drift_frame: u64,
}

/// Where a phase the edge remembers stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Accepted and being adapted; not answered yet.
    Pending,
    /// Adapted and answered; its answer is kept.
    Answered,
}

/// What to do with an upload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UploadKind {
    /// A phase not seen before: adapt it.
    Fresh,
    /// The phase is being adapted (the camera restarted while it waited): answer this upload
    /// with that adaptation's answer when it comes.
    InFlight,
    /// The phase was adapted (the camera restarted after its answer): send the kept answer
    /// again, without adapting twice.
    Replay,
    /// Refused, with the reason.
    Refused(String),
}

/// Classifies `upload` of one camera against the phases the edge remembers of it (`known`,
/// any order), with adaptation indices capped below `max_phases`.
pub fn classify(known: &[(Phase, Seen)], upload: Phase, max_phases: u32) -> UploadKind {
    if upload.adaptation >= max_phases {
        return UploadKind::Refused(format!(
            "adaptation {} is past the {max_phases} drift phases the edge keeps per camera",
            upload.adaptation
        ));
    }
    if let Some((p, seen)) = known.iter().find(|(p, _)| p.adaptation == upload.adaptation) {
        if p.drift_frame != upload.drift_frame {
            return UploadKind::Refused(format!(
                "adaptation {} was uploaded at drift frame {} before, not {}",
                upload.adaptation, p.drift_frame, upload.drift_frame
            ));
        }
        return match seen {
            Seen::Pending => UploadKind::InFlight,
            Seen::Answered => UploadKind::Replay,
        };
    }
    let out_of_order = known.iter().find(|(p, _)| {
        (p.adaptation < upload.adaptation && p.drift_frame >= upload.drift_frame)
            || (p.adaptation > upload.adaptation && p.drift_frame <= upload.drift_frame)
    });
    if let Some((p, _)) = out_of_order {
        return UploadKind::Refused(format!(
            "adaptation {} at drift frame {} is out of stream order with adaptation {} at frame {}",
            upload.adaptation, upload.drift_frame, p.adaptation, p.drift_frame
        ));
    }
    UploadKind::Fresh
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phase(adaptation: u32, drift_frame: u64) -> Phase {
        Phase { adaptation, drift_frame }
    }

    #[test]
    fn a_restarted_cameras_repeats_are_recognised_and_new_phases_are_fresh() {
        let known = [(phase(0, 320), Seen::Answered), (phase(1, 900), Seen::Pending)];
        // the restarted camera's first drift again: answered from memory
        assert_eq!(classify(&known, phase(0, 320), 4), UploadKind::Replay);
        // its second, still being adapted: wait for that answer
        assert_eq!(classify(&known, phase(1, 900), 4), UploadKind::InFlight);
        // a third drift later in the stream: adapt it
        assert_eq!(classify(&known, phase(2, 1200), 4), UploadKind::Fresh);
        // a camera never heard from
        assert_eq!(classify(&[], phase(0, 64), 4), UploadKind::Fresh);
    }

    #[test]
    fn conflicting_claims_and_indices_past_the_cap_are_refused_by_name() {
        let known = [(phase(0, 320), Seen::Answered), (phase(2, 1200), Seen::Pending)];
        let UploadKind::Refused(why) = classify(&known, phase(0, 384), 4) else { panic!() };
        assert!(why.contains("adaptation 0") && why.contains("320") && why.contains("384"), "{why}");
        // a phase between two known ones must lie between their frames
        assert_eq!(classify(&known, phase(1, 800), 4), UploadKind::Fresh);
        let UploadKind::Refused(why) = classify(&known, phase(1, 200), 4) else { panic!() };
        assert!(why.contains("out of stream order") && why.contains("adaptation 0"), "{why}");
        let UploadKind::Refused(why) = classify(&known, phase(1, 1300), 4) else { panic!() };
        assert!(why.contains("out of stream order") && why.contains("adaptation 2"), "{why}");
        let UploadKind::Refused(why) = classify(&known, phase(4, 2000), 4) else { panic!() };
        assert!(why.contains("adaptation 4") && why.contains('4'), "{why}");
        assert_eq!(classify(&known, phase(3, 2000), 4), UploadKind::Fresh);
    }
}
