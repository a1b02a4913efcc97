//! The accuracy record `coe gen` writes beside an app (`accuracy.txt`): the trained CoE's
//! accuracy on the held-out split next to a single MLP of the same total bytes, so benches and
//! users can read the figures without retraining.

use std::collections::BTreeMap;
use std::path::Path;

use super::CoeError;
use super::app::read_capped;

/// First line of an accuracy record.
pub const ACCURACY_FORMAT: &str = "format troupe-coe-accuracy 1";
/// Name of the file in the app folder.
pub const ACCURACY_FILE: &str = "accuracy.txt";
/// Largest record accepted, bytes.
const MAX_ACCURACY_BYTES: u64 = 4 << 10;

/// Accuracies of a generated app, measured with ONNX Runtime on the held-out split.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Accuracy {
    /// Share of test images the CoE answers right (entry experts weighted by the request mix).
    pub coe_accuracy: f64,
    /// Share a single MLP of the CoE's total bytes answers right (NaN: not trained, over the cap).
    pub single_model_accuracy: f64,
    /// Bytes of the single model's ONNX file (0 when not trained).
    pub single_model_bytes: u64,
    /// Bytes of all the CoE's ONNX files.
    pub expert_bytes: u64,
    /// Images in the train / calibration / test splits.
    pub train_images: usize,
    /// Calibration images (usage probabilities).
    pub calibration_images: usize,
    /// Held-out images (the accuracies).
    pub test_images: usize,
    /// Training passes every model got.
    pub epochs: usize,
    /// Share of the CoE's test walks that reach a leaf whose group holds the digit's class (the
    /// preliminaries routed it right; NaN in records written before it was measured).
    pub routed_share: f64,
    /// The CoE's accuracy over the walks routed right (NaN as above).
    pub accuracy_when_routed: f64,
}

impl Accuracy {
    /// Text form: the format line, then one `name value` line per field.
    pub fn to_text(&self) -> String {
        format!(
            "{ACCURACY_FORMAT}\ncoe_accuracy {}\nsingle_model_accuracy {}\nsingle_model_bytes {}\nexpert_bytes {}\ntrain_images {}\ncalibration_images {}\ntest_images {}\nepochs {}\nrouted_share {}\naccuracy_when_routed {}\n",
            self.coe_accuracy,
            self.single_model_accuracy,
            self.single_model_bytes,
            self.expert_bytes,
            self.train_images,
            self.calibration_images,
            self.test_images,
            self.epochs,
            self.routed_share,
            self.accuracy_when_routed
        )
    }

    /// Parse a record (untrusted: every field required, accuracies in [0, 1] or NaN).
    pub fn parse(text: &str, origin: &Path) -> Result<Accuracy, CoeError> {
        let bad = |problem: String| CoeError::BadFile { path: origin.to_path_buf(), problem };
        let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
        if lines.next() != Some(ACCURACY_FORMAT) {
            return Err(bad(format!("expected `{ACCURACY_FORMAT}` first")));
        }
        let mut pairs = BTreeMap::new();
        for line in lines {
            let mut t = line.split_whitespace();
            match (t.next(), t.next(), t.next()) {
                (Some(k), Some(v), None) => {
                    pairs.insert(k, v);
                }
                _ => return Err(bad(format!("unrecognised line `{line}`"))),
            }
        }
        fn get<T: std::str::FromStr>(pairs: &BTreeMap<&str, &str>, k: &str) -> Result<T, String> {
            pairs.get(k).ok_or(format!("no `{k}`"))?.parse().map_err(|_| format!("bad `{k}`"))
        }
        fn optional(pairs: &BTreeMap<&str, &str>, k: &str) -> Result<f64, String> {
            pairs.get(k).map_or(Ok(f64::NAN), |v| v.parse().map_err(|_| format!("bad `{k}`")))
        }
        let a = (|| -> Result<Accuracy, String> {
            Ok(Accuracy {
                coe_accuracy: get(&pairs, "coe_accuracy")?,
                single_model_accuracy: get(&pairs, "single_model_accuracy")?,
                single_model_bytes: get(&pairs, "single_model_bytes")?,
                expert_bytes: get(&pairs, "expert_bytes")?,
                train_images: get(&pairs, "train_images")?,
                calibration_images: get(&pairs, "calibration_images")?,
                test_images: get(&pairs, "test_images")?,
                epochs: get(&pairs, "epochs")?,
                routed_share: optional(&pairs, "routed_share")?,
                accuracy_when_routed: optional(&pairs, "accuracy_when_routed")?,
            })
        })()
        .map_err(bad)?;
        for (name, v) in [
            ("coe_accuracy", a.coe_accuracy),
            ("single_model_accuracy", a.single_model_accuracy),
            ("routed_share", a.routed_share),
            ("accuracy_when_routed", a.accuracy_when_routed),
        ] {
            if !(v.is_nan() || (0.0..=1.0).contains(&v)) {
                return Err(bad(format!("{name} {v} is not in [0, 1]")));
            }
        }
        Ok(a)
    }

    /// Read `dir/accuracy.txt` (size-capped).
    pub fn read(dir: &Path) -> Result<Accuracy, CoeError> {
        let path = dir.join(ACCURACY_FILE);
        Accuracy::parse(&read_capped(&path, MAX_ACCURACY_BYTES)?, &path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_rejects_garbage() {
        let a = Accuracy {
            coe_accuracy: 0.95,
            single_model_accuracy: f64::NAN,
            single_model_bytes: 0,
            expert_bytes: 123,
            train_images: 1078,
            calibration_images: 359,
            test_images: 360,
            epochs: 8,
            routed_share: 0.96,
            accuracy_when_routed: 0.98,
        };
        let p = Path::new("accuracy.txt");
        let back = Accuracy::parse(&a.to_text(), p).unwrap();
        assert!(back.single_model_accuracy.is_nan());
        assert_eq!(
            Accuracy { single_model_accuracy: 0.5, ..back },
            Accuracy { single_model_accuracy: 0.5, ..a }
        );
        let err =
            Accuracy::parse(&a.to_text().replace("coe_accuracy 0.95", "coe_accuracy 1.5"), p).unwrap_err();
        assert!(err.to_string().contains("accuracy.txt") && err.to_string().contains("[0, 1]"), "{err}");
        let err = Accuracy::parse(&a.to_text().replace("epochs 8\n", ""), p).unwrap_err();
        assert!(err.to_string().contains("no `epochs`"), "{err}");
        assert!(Accuracy::parse("nonsense", p).is_err());
        // A record from before the routing figures reads them as NaN; a bad one is refused.
        let old = a.to_text().replace("routed_share 0.96\n", "").replace("accuracy_when_routed 0.98\n", "");
        let back = Accuracy::parse(&old, p).unwrap();
        assert!(back.routed_share.is_nan() && back.accuracy_when_routed.is_nan());
        let err =
            Accuracy::parse(&a.to_text().replace("routed_share 0.96", "routed_share 2"), p).unwrap_err();
        assert!(err.to_string().contains("routed_share 2 is not in [0, 1]"), "{err}");
    }
}
