//! Sentence embeddings with all-MiniLM-L6-v2: WordPiece ids and mask in, the whole-model graph's
//! `sentence_embedding` (mean-pooled, L2-normalised, 384 floats per text) out.

use super::OnnxError;
use super::session::{OnnxSession, SessionConfig};
use super::tensor::NamedTensor;
use crate::assets::{self, Assets};
use crate::tokenizer::WordPiece;

/// A loaded tokenizer and MiniLM session, for embedding many batches.
#[derive(Debug)]
pub struct Embedder {
    tokenizer: WordPiece,
    session: OnnxSession,
}

impl Embedder {
    /// Loads the vocabulary and `models/minilm_whole.onnx` from the setup cache.
    pub fn from_assets(assets: &Assets, config: &SessionConfig) -> Result<Self, OnnxError> {
        let tokenizer = WordPiece::from_assets(assets)?;
        let session = OnnxSession::from_file(&assets.path(assets::MINILM_WHOLE)?, config)?;
        Ok(Self { tokenizer, session })
    }

    /// The session (for its memory figures and IO specs).
    pub fn session(&self) -> &OnnxSession {
        &self.session
    }

    /// One embedding per text (unit length; empty input gives no rows).
    pub fn embed<S: AsRef<str>>(&mut self, texts: &[S]) -> Result<Vec<Vec<f32>>, OnnxError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let batch = self.tokenizer.encode_batch(texts);
        let shape = vec![batch.batch, batch.seq_len];
        let outputs = self.session.run(&[
            NamedTensor::i64("input_ids", shape.clone(), batch.ids),
            NamedTensor::i64("attention_mask", shape, batch.attention_mask),
        ])?;
        let origin = self.session.origin().to_owned();
        let bad = |detail: String| OnnxError::Run { origin: origin.clone(), detail };
        let out = outputs
            .iter()
            .find(|t| t.name == "sentence_embedding")
            .ok_or_else(|| bad("no sentence_embedding output".into()))?;
        let data = out.as_f32().ok_or_else(|| bad("sentence_embedding is not f32".into()))?;
        match out.shape[..] {
            [rows, dim] if rows == texts.len() && dim > 0 => {
                Ok(data.chunks(dim).map(<[f32]>::to_vec).collect())
            }
            _ => Err(bad(format!("sentence_embedding has shape {:?} for {} texts", out.shape, texts.len()))),
        }
    }
}

/// Embeds `texts` with a one-off [`Embedder`] from the setup cache (for `troupe embed "text"`).
pub fn embed<S: AsRef<str>>(texts: &[S]) -> Result<Vec<Vec<f32>>, OnnxError> {
    let assets = Assets::locate()?;
    Embedder::from_assets(&assets, &SessionConfig::default())?.embed(texts)
}

/// Cosine similarity of two vectors (0 when either is all zeros).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    if na == 0.0 || nb == 0.0 { 0.0 } else { dot / (na * nb) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_of_simple_vectors() {
        assert!((cosine(&[1.0, 0.0], &[0.0, 2.0])).abs() < 1e-7);
        assert!((cosine(&[1.0, 1.0], &[2.0, 2.0]) - 1.0).abs() < 1e-6);
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 1.0]), 0.0);
    }
}
