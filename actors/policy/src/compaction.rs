//! When an append-only journal is rewritten to only its live records: once it is past a size
//! threshold and has at least doubled since its last rewrite. The doubling keeps the rewriting
//! amortised (each rewrite is paid for by as many bytes appended since), even when the live set
//! itself is larger than the threshold.

/// Default threshold: a journal under it is never rewritten.
pub const DEFAULT_THRESHOLD: u64 = 64 << 20;

/// The rule: rewrite at `threshold` bytes, and then only once the file is twice its size right
/// after the last rewrite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompactionRule {
    /// Bytes below which the journal is never rewritten.
    pub threshold: u64,
}

impl Default for CompactionRule {
    fn default() -> Self {
        CompactionRule { threshold: DEFAULT_THRESHOLD }
    }
}

impl CompactionRule {
    /// Whether a journal of `bytes` bytes, which was `base` bytes right after its last rewrite
    /// (0 if none since it was opened), is due for one.
    pub fn due(&self, bytes: u64, base: u64) -> bool {
        bytes >= self.threshold && bytes >= base.saturating_mul(2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_past_the_threshold_and_twice_the_last_rewrite() {
        let rule = CompactionRule { threshold: 1000 };
        assert!(!rule.due(999, 0), "under the threshold");
        assert!(rule.due(1000, 0), "at it, never rewritten");
        assert!(rule.due(1000, 500));
        assert!(!rule.due(1000, 501), "the live set is over half: not yet");
        assert!(rule.due(1002, 501));
        assert!(!rule.due(u64::MAX - 1, u64::MAX / 2 + 1), "no overflow");
        assert_eq!(CompactionRule::default().threshold, 64 << 20);
    }
}
