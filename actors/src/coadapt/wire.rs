//! What cameras and the edge send each other (rkyv bytes inside ractor_cluster messages). Every
//! decode is checked: a length cap before copying, rkyv validation, then field checks that name
//! what is wrong. Peer bytes are never trusted.
//!
//! Every decode goes through the runtime's one decode path ([`crate::decode`]) and takes the
//! message's decoded-bytes budget ([`DecodeBudget`]), charged before copying: these messages
//! carry plain f32/u32 vectors and strings (no compressed tensors), so what one decodes to is
//! bounded by its wire size ([`DECODED_PER_WIRE_BYTE`] per byte).

use rkyv::rancor;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

pub use crate::decode::{DECODED_PER_WIRE_BYTE, DecodeBudget, DecodeError};

/// Largest encoded message accepted from a peer (uploads of a few hundred 8x8 images are ~100 KiB).
pub const MAX_WIRE_BYTES: usize = crate::decode::MAX_MESSAGE_BYTES;
/// Default decoded-bytes budget of one message: the largest message accepted, decoded.
pub const MAX_DECODED_BYTES: u64 = crate::decode::MAX_PLAIN_DECODED_BYTES;
/// Most images one upload may carry.
pub const MAX_UPLOAD_IMAGES: usize = 20_000;
/// Pixels per image (8x8 digits).
pub const PIXELS: usize = 64;

/// Why peer bytes were refused.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Over the size cap or the budget, or not a valid archive.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The message decoded but a field makes no sense.
    #[error("{what}: {detail}")]
    Invalid {
        /// Message type.
        what: &'static str,
        /// What is wrong.
        detail: String,
    },
}

/// A camera's adaptation request: the model it runs, samples it uploaded after noticing drift,
/// and the images of its held-out evaluation window (the teacher labels both on the edge).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct UploadRequest {
    /// Camera (node) name.
    pub camera: String,
    /// Student size the camera runs (`tiny`, `small`, `base`, `large`).
    pub model: String,
    /// The camera's current trainable parameters (experts, projector, head; see
    /// [`super::params::trainable_params`]), so the edge adapts exactly the camera's model.
    pub params: Vec<f32>,
    /// Uploaded frames, `n * 64` pixels in `0..=1`.
    pub train_images: Vec<f32>,
    /// Held-out evaluation frames (never trained on), `m * 64` pixels.
    pub eval_images: Vec<f32>,
    /// The camera's adaptation index for this drift phase (0 for its first drift, 1 for the
    /// next, ...): with `drift_frame` it names the phase, so the edge recognises a restarted
    /// camera's repeated upload (see `troupe_policy::adapt::replay`).
    pub adaptation: u32,
    /// Frame at which the camera noticed drift.
    pub drift_frame: u64,
    /// The objective: exact-match gain against the teacher at which adaptation may stop
    /// (0 = the edge's default).
    pub target_gain: f64,
}

/// The edge's answer: adapted parameters and the teacher's labels of the evaluation frames.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct AdaptReply {
    /// Task id on the edge.
    pub task: u32,
    /// Adapted trainable parameters (same layout as the request's).
    pub params: Vec<f32>,
    /// Teacher labels of the request's evaluation frames, in order.
    pub eval_teacher_labels: Vec<u32>,
    /// Exact match against the teacher on the edge's validation split, before adaptation.
    pub val_before: f64,
    /// The same after adaptation.
    pub val_after: f64,
    /// Epochs trained.
    pub epochs: u32,
    /// Whether the target gain was reached.
    pub reached: bool,
    /// Arrival to completion on the edge, milliseconds.
    pub latency_ms: u64,
}

/// Most accuracy samples one camera reports (its log decimates to stay under it).
pub const MAX_SAMPLES: usize = 512;
/// Most adaptations one camera may ask for over its stream (and report).
pub const MAX_ADAPTATIONS: usize = 64;
/// Most drift phases a camera reports from its schedule (for the plot's marks).
pub const MAX_PHASE_MARKS: usize = 64;
/// Longest camera name or weather name accepted from a peer, in bytes.
pub const MAX_NAME_BYTES: usize = 128;
/// Longest error text accepted in a report, in bytes.
pub const MAX_ERROR_BYTES: usize = 4096;

/// The figures of one adaptation, kept by the camera after it installed the update (or failed).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct CameraReport {
    /// Camera name.
    pub camera: String,
    /// Which adaptation of this camera (0-based, in stream order).
    pub adaptation: u32,
    /// Frame at which drift was noticed (`u64::MAX` when it never was).
    pub drift_frame: u64,
    /// Frame at which the update was installed (the stream resumes there).
    pub installed_frame: u64,
    /// Exact match with the teacher on the evaluation window, before the update.
    pub exact_before: f64,
    /// The same after installing the update.
    pub exact_after: f64,
    /// Accuracy against the true labels on the evaluation window, before.
    pub accuracy_before: f64,
    /// The same after.
    pub accuracy_after: f64,
    /// Edge latency of the adaptation, milliseconds.
    pub latency_ms: u64,
    /// An error, when the camera could not complete (empty on success).
    pub error: String,
}

/// One accuracy sample of a camera's stream: the batch of frames ending at `frame`.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
pub struct AccuracySample {
    /// Frames streamed when the batch ended.
    pub frame: u64,
    /// Accuracy of the batch against the stream's true labels (known in this simulated feed).
    pub accuracy: f32,
    /// The batch's mean top-1 confidence (what the drift detector sees).
    pub confidence: f32,
}

/// Where a drift phase of the camera's schedule starts (for marking the plot).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct PhaseMark {
    /// First frame of the phase.
    pub start_frame: u64,
    /// Its weather, e.g. `fog 0.8`.
    pub weather: String,
}

/// A camera's whole progress so far, sent to the edge periodically and when its stream ends.
/// Each report replaces the previous one (a snapshot, so a lost or repeated report is harmless).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StreamReport {
    /// Camera name.
    pub camera: String,
    /// Frames streamed so far.
    pub frame: u64,
    /// Frames its stream has in all.
    pub frames: u64,
    /// The whole stream has been streamed.
    pub ended: bool,
    /// Adaptations asked of the edge so far.
    pub requested: u32,
    /// Its schedule's phases.
    pub phases: Vec<PhaseMark>,
    /// Accuracy over time (at most [`MAX_SAMPLES`], evenly spaced over the stream).
    pub samples: Vec<AccuracySample>,
    /// Adaptations that came back, in order.
    pub adaptations: Vec<CameraReport>,
    /// Why the stream stopped before its end (empty when it did not).
    pub error: String,
}

impl StreamReport {
    /// Decodes and checks a camera's report: charged to `budget`, lists within their caps, names
    /// short, figures finite, adaptations no more than requested.
    pub fn decode(bytes: &[u8], budget: &mut DecodeBudget) -> Result<Self, WireError> {
        let r: Self = decode(Self::WHAT, bytes, budget)?;
        r.check()?;
        Ok(r)
    }

    const WHAT: &str = "stream report";

    /// Checks a report decoded from a peer (by [`StreamReport::decode`] or the typed actors'
    /// checked path): lists within their caps, names short, figures finite, adaptations no more
    /// than requested.
    pub fn check(&self) -> Result<(), WireError> {
        let r = self;
        let bad = |detail: String| Err(WireError::Invalid { what: Self::WHAT, detail });
        if r.camera.is_empty() || r.camera.len() > MAX_NAME_BYTES {
            return bad(format!("camera name of {} bytes", r.camera.len()));
        }
        for (name, n, cap) in [
            ("phases", r.phases.len(), MAX_PHASE_MARKS),
            ("samples", r.samples.len(), MAX_SAMPLES),
            ("adaptations", r.adaptations.len(), MAX_ADAPTATIONS),
        ] {
            if n > cap {
                return bad(format!("{name}: {n} entries exceed {cap}"));
            }
        }
        if r.adaptations.len() > r.requested as usize {
            return bad(format!("{} adaptations reported, {} requested", r.adaptations.len(), r.requested));
        }
        if r.error.len() > MAX_ERROR_BYTES {
            return bad(format!("error of {} bytes", r.error.len()));
        }
        if let Some(p) = r.phases.iter().find(|p| p.weather.len() > MAX_NAME_BYTES) {
            return bad(format!("phase weather of {} bytes", p.weather.len()));
        }
        if let Some(s) = r.samples.iter().find(|s| !s.accuracy.is_finite() || !s.confidence.is_finite()) {
            return bad(format!("sample at frame {} is not finite", s.frame));
        }
        for a in &r.adaptations {
            if a.camera != r.camera {
                return bad(format!("adaptation of camera {:?} in the report of {:?}", a.camera, r.camera));
            }
            if a.error.len() > MAX_ERROR_BYTES {
                return bad(format!("adaptation {}: error of {} bytes", a.adaptation, a.error.len()));
            }
            let figures = [a.exact_before, a.exact_after, a.accuracy_before, a.accuracy_after];
            if figures.iter().any(|v| !v.is_finite()) {
                return bad(format!("adaptation {}: a figure is not finite", a.adaptation));
            }
        }
        Ok(())
    }
}

/// The edge's summary for the job: every camera's progress plus memory figures.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct EdgeSummary {
    /// Camera reports, in the order cameras were first heard from.
    pub cameras: Vec<StreamReport>,
    /// Pool budget in bytes.
    pub budget: u64,
    /// Most pool bytes ever in use.
    pub peak_used: u64,
    /// Pool events sampled.
    pub events: u64,
    /// Largest external fragmentation seen (0..1).
    pub max_fragmentation: f64,
    /// Mean external fragmentation over events (0..1).
    pub mean_fragmentation: f64,
    /// `(event, used bytes, fragmentation)` every few events, for a timeline.
    pub timeline: Vec<(u64, u64, f64)>,
    /// Tasks completed by the scheduler.
    pub tasks_done: u32,
    /// Scheduler name.
    pub scheduler: String,
}

/// Encodes a message.
pub fn encode<T>(value: &T) -> Vec<u8>
where
    T: for<'a> Serialize<
        rkyv::api::high::HighSerializer<AlignedVec, rkyv::ser::allocator::ArenaHandle<'a>, rancor::Error>,
    >,
{
    rkyv::to_bytes::<rancor::Error>(value).map(|v| v.to_vec()).unwrap_or_default()
}

/// Checked decode of peer bytes (capped, charged to `budget`, copied to an aligned buffer,
/// validated), through the runtime's one decode path.
pub fn decode<T>(what: &'static str, bytes: &[u8], budget: &mut DecodeBudget) -> Result<T, WireError>
where
    T: Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rancor::Error>>
        + Deserialize<T, rkyv::api::high::HighDeserializer<rancor::Error>>,
{
    Ok(crate::decode::decode(what, bytes, MAX_WIRE_BYTES, budget)?)
}

impl UploadRequest {
    /// Decodes and checks an upload: charged to `budget`, image buffers whole and within caps,
    /// pixels finite.
    pub fn decode(bytes: &[u8], budget: &mut DecodeBudget) -> Result<Self, WireError> {
        let r: Self = decode(Self::WHAT, bytes, budget)?;
        r.check()?;
        Ok(r)
    }

    const WHAT: &str = "upload request";

    /// Checks an upload decoded from a peer (by [`UploadRequest::decode`] or the typed actors'
    /// checked path): image buffers whole and within caps, pixels finite.
    pub fn check(&self) -> Result<(), WireError> {
        let r = self;
        let bad = |detail: String| Err(WireError::Invalid { what: Self::WHAT, detail });
        for (name, px) in [("train_images", &r.train_images), ("eval_images", &r.eval_images)] {
            if px.is_empty() || !px.len().is_multiple_of(PIXELS) {
                return bad(format!("{name}: {} pixels is not a positive multiple of {PIXELS}", px.len()));
            }
            if px.len() / PIXELS > MAX_UPLOAD_IMAGES {
                return bad(format!("{name}: {} images exceed {MAX_UPLOAD_IMAGES}", px.len() / PIXELS));
            }
            if let Some(v) = px.iter().find(|v| !v.is_finite()) {
                return bad(format!("{name}: pixel {v} is not finite"));
            }
        }
        if !(0.0..1.0).contains(&r.target_gain) {
            return bad(format!("target_gain {} is outside 0..1", r.target_gain));
        }
        if r.camera.is_empty() || r.camera.len() > 128 {
            return bad(format!("camera name of {} bytes", r.camera.len()));
        }
        if r.adaptation as usize >= MAX_ADAPTATIONS {
            return bad(format!("adaptation {} is not below {MAX_ADAPTATIONS}", r.adaptation));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> DecodeBudget {
        DecodeBudget::new(MAX_DECODED_BYTES)
    }

    fn upload() -> UploadRequest {
        UploadRequest {
            camera: "cam-1".into(),
            model: "tiny".into(),
            params: vec![0.5; 10],
            train_images: vec![0.1; 2 * PIXELS],
            eval_images: vec![0.2; PIXELS],
            adaptation: 0,
            drift_frame: 130,
            target_gain: 0.1,
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let u = upload();
        let bytes = encode(&u);
        assert_eq!(UploadRequest::decode(&bytes, &mut budget()).unwrap(), u);
        // Truncated and flipped bytes are refused with a message, never a panic.
        assert!(matches!(
            UploadRequest::decode(&bytes[..bytes.len() / 2], &mut budget()),
            Err(WireError::Decode(DecodeError::Malformed { .. }))
        ));
        assert!(UploadRequest::decode(&[0xff; 3], &mut budget()).is_err());
        // A ragged image buffer decodes but is invalid, and the error names the field.
        let ragged = UploadRequest { train_images: vec![0.1; PIXELS + 1], ..u.clone() };
        let e = UploadRequest::decode(&encode(&ragged), &mut budget()).unwrap_err().to_string();
        assert!(e.contains("train_images"), "{e}");
        let nan = UploadRequest { eval_images: vec![f32::NAN; PIXELS], ..u };
        let e = UploadRequest::decode(&encode(&nan), &mut budget()).unwrap_err().to_string();
        assert!(e.contains("eval_images") && e.contains("finite"), "{e}");
        let e =
            UploadRequest::decode(&encode(&UploadRequest { target_gain: 2.0, ..upload() }), &mut budget())
                .unwrap_err();
        assert!(e.to_string().contains("target_gain"), "{e}");
        let far = UploadRequest { adaptation: MAX_ADAPTATIONS as u32, ..upload() };
        let e = UploadRequest::decode(&encode(&far), &mut budget()).unwrap_err();
        assert!(e.to_string().contains("adaptation"), "{e}");
        let big = vec![0u8; MAX_WIRE_BYTES + 1];
        assert!(matches!(
            UploadRequest::decode(&big, &mut budget()),
            Err(WireError::Decode(DecodeError::TooLarge { .. }))
        ));
    }

    #[test]
    fn decodes_are_charged_to_the_message_budget_before_copying() {
        let bytes = encode(&upload());
        let mut b = budget();
        UploadRequest::decode(&bytes, &mut b).unwrap();
        assert_eq!(b.used(), bytes.len() as u64 * DECODED_PER_WIRE_BYTE);
        // a budget that cannot hold it refuses, naming the budget, and charges nothing
        let mut small = DecodeBudget::new(bytes.len() as u64);
        let e = UploadRequest::decode(&bytes, &mut small).unwrap_err();
        assert!(matches!(e, WireError::Decode(DecodeError::OverBudget { .. })), "{e}");
        assert!(e.to_string().contains("decoded-bytes budget"), "{e}");
        assert_eq!(small.used(), 0);
        // the bound holds: a message of strings only (24-byte headers, 8-byte archives)
        let report = CameraReport {
            camera: "c".repeat(8),
            adaptation: 0,
            drift_frame: 0,
            installed_frame: 0,
            exact_before: 0.0,
            exact_after: 0.0,
            accuracy_before: 0.0,
            accuracy_after: 0.0,
            latency_ms: 0,
            error: "e".repeat(8),
        };
        let stream = StreamReport { adaptations: vec![report; 1000], requested: 1000, ..stream() };
        let s = EdgeSummary { cameras: vec![stream], ..summary() };
        let bytes = encode(&s);
        let native = s.cameras[0].adaptations.len() * (std::mem::size_of::<CameraReport>() + 16);
        assert!(
            (native as u64) < bytes.len() as u64 * (DECODED_PER_WIRE_BYTE - 1),
            "{native} vs {}",
            bytes.len()
        );
        assert_eq!(decode::<EdgeSummary>("edge summary", &bytes, &mut budget()).unwrap(), s);
    }

    fn stream() -> StreamReport {
        StreamReport {
            camera: "c".repeat(8),
            frame: 64,
            frames: 1024,
            ended: false,
            requested: 1,
            phases: vec![PhaseMark { start_frame: 0, weather: "clean 0".into() }],
            samples: vec![AccuracySample { frame: 64, accuracy: 0.9, confidence: 0.8 }],
            adaptations: Vec::new(),
            error: String::new(),
        }
    }

    #[test]
    fn stream_reports_are_checked_field_by_field() {
        let s = stream();
        assert_eq!(StreamReport::decode(&encode(&s), &mut budget()).unwrap(), s);
        let e = |r: StreamReport| StreamReport::decode(&encode(&r), &mut budget()).unwrap_err().to_string();
        let many = StreamReport { samples: vec![s.samples[0]; MAX_SAMPLES + 1], ..stream() };
        assert!(e(many).contains("samples"), "capped");
        let nan = StreamReport {
            samples: vec![AccuracySample { frame: 3, accuracy: f32::NAN, confidence: 0.5 }],
            ..stream()
        };
        assert!(e(nan).contains("frame 3"));
        let a = CameraReport {
            camera: s.camera.clone(),
            adaptation: 0,
            drift_frame: 1,
            installed_frame: 2,
            exact_before: 0.1,
            exact_after: 0.2,
            accuracy_before: 0.1,
            accuracy_after: 0.2,
            latency_ms: 1,
            error: String::new(),
        };
        let too_many = StreamReport { adaptations: vec![a.clone(), a.clone()], ..stream() };
        assert!(e(too_many).contains("2 adaptations reported, 1 requested"));
        let other = StreamReport { adaptations: vec![CameraReport { camera: "x".into(), ..a }], ..stream() };
        assert!(e(other).contains("in the report of"));
        assert!(e(StreamReport { camera: String::new(), ..stream() }).contains("camera name"));
        assert!(StreamReport::decode(&[1, 2, 3], &mut budget()).is_err());
    }

    fn summary() -> EdgeSummary {
        EdgeSummary {
            cameras: Vec::new(),
            budget: 1,
            peak_used: 0,
            events: 0,
            max_fragmentation: 0.0,
            mean_fragmentation: 0.0,
            timeline: Vec::new(),
            tasks_done: 0,
            scheduler: "twin".into(),
        }
    }
}
