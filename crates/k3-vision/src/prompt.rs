//! Images in prompts, around-backbone §3.9: the media block and the `<|media_pad|>` expansion.
//!
//! Shape legend: `ids` `[T]` token ids; an image whose grid is `(1, h, w)` takes
//! `N = (h/2)·(w/2)` pad ids. The block is
//! `<|media_begin|> BPE("image {W}x{H}") <|media_content|> <|media_pad|>×N <|media_end|>`, with the
//! **original** width and height. The official processor renders one pad per image
//! (`make_image_prompt`); the text model sees N.

use crate::error::{Result, VisionError};

/// Ids of the four media special tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MediaTokens {
    pub begin: u32,
    pub content: u32,
    pub end: u32,
    pub pad: u32,
}

impl MediaTokens {
    /// The release: 163584 + 18..21.
    pub const K3: MediaTokens = MediaTokens { begin: 163602, content: 163603, end: 163604, pad: 163605 };
}

/// The image block as text with `num_pads` pads (`1` gives the official processor's string).
pub fn image_prompt_text(width: usize, height: usize, num_pads: usize) -> String {
    format!("<|media_begin|>image {width}x{height}<|media_content|>{}<|media_end|>", "<|media_pad|>".repeat(num_pads))
}

/// The image block as ids, given the BPE ids of the text `image {W}x{H}`.
pub fn image_block_ids(tokens: &MediaTokens, framing_ids: &[u32], num_pads: usize) -> Vec<u32> {
    let mut v = Vec::with_capacity(framing_ids.len() + num_pads + 3);
    v.push(tokens.begin);
    v.extend_from_slice(framing_ids);
    v.push(tokens.content);
    v.extend(std::iter::repeat_n(tokens.pad, num_pads));
    v.push(tokens.end);
    v
}

/// Tokens an image of grid `(t, h, w)` takes with a `kh × kw` merge (temporal frames pool to one).
pub fn num_image_tokens(grid: [usize; 3], kh: usize, kw: usize) -> usize {
    (grid[1] / kh.max(1)) * (grid[2] / kw.max(1))
}

/// Maximal runs of `pad` in `ids`: `(start, len)`.
pub fn pad_runs(ids: &[u32], pad: u32) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (i, &t) in ids.iter().enumerate() {
        if t == pad {
            match runs.last_mut() {
                Some((s, n)) if *s + *n == i => *n += 1,
                _ => runs.push((i, 1)),
            }
        }
    }
    runs
}

/// Replaces the k-th single `pad` of `ids` (one per image, as the official processor emits them)
/// by `counts[k]` pads. The number of pads must equal `counts.len()`.
pub fn expand_pads(ids: &[u32], pad: u32, counts: &[usize]) -> Result<Vec<u32>> {
    let found = ids.iter().filter(|&&t| t == pad).count();
    if found != counts.len() {
        return Err(VisionError::Splice(format!(
            "the prompt holds {found} <|media_pad|> (id {pad}) but {} images were given; expected one pad per image before expansion",
            counts.len()
        )));
    }
    let mut out = Vec::with_capacity(ids.len() + counts.iter().sum::<usize>());
    let mut k = 0;
    for &t in ids {
        if t == pad {
            out.extend(std::iter::repeat_n(pad, counts[k]));
            k += 1;
        } else {
            out.push(t);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_text_and_ids() {
        assert_eq!(image_prompt_text(45, 33, 1), "<|media_begin|>image 45x33<|media_content|><|media_pad|><|media_end|>");
        let t = MediaTokens { begin: 1, content: 2, end: 3, pad: 9 };
        assert_eq!(image_block_ids(&t, &[7, 8], 2), vec![1, 7, 8, 2, 9, 9, 3]);
        assert_eq!(num_image_tokens([1, 78, 138], 2, 2), 2691);
    }

    #[test]
    fn runs_and_expansion() {
        assert_eq!(pad_runs(&[9, 9, 1, 9, 3, 9, 9, 9], 9), vec![(0, 2), (3, 1), (5, 3)]);
        assert_eq!(expand_pads(&[1, 9, 2, 9], 9, &[3, 1]).unwrap(), vec![1, 9, 9, 9, 2, 9]);
        let e = expand_pads(&[1, 9, 2], 9, &[3, 1]).unwrap_err().to_string();
        assert!(e.contains("holds 1") && e.contains("2 images"), "{e}");
    }
}
