//! Derives the token list for a reduced-vocabulary draft head
//! (`[draft] head_tokens`, `specgate generate --draft-head-tokens`): the
//! most frequent tokens of a text corpus under a GGUF model's tokenizer,
//! plus every control token (`<|...|>`) and end-of-sequence token, so chat
//! framing stays proposable.
//!
//! Run (the committed list came from exactly this):
//! `cargo run --release --example draft_vocab -- models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 32768 configs/draft-head-qwen2.5.txt ~/.cargo/registry/src /usr/lib/python3.11`
//! Arguments: model, list size, output file, then corpus directories; at
//! most 32 MiB of text is read from each directory (files in sorted path
//! order, `.rs`, `.py`, `.md`, `.txt`, `.toml` only), so the list is
//! reproducible on the same inputs.

use specgate::tokenizer::TextTokenizer;
use std::io::Write;
use std::path::{Path, PathBuf};

const PER_DIR_BYTES: usize = 32 << 20;

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            files(&p, out);
        } else if matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("rs" | "py" | "md" | "txt" | "toml")
        ) {
            out.push(p);
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        args.len() >= 4,
        "usage: draft_vocab MODEL.gguf SIZE OUT DIR..."
    );
    let tok = TextTokenizer::from_gguf_file(Path::new(&args[0]))?;
    let size: usize = args[1].parse()?;
    let mut counts = vec![0u64; tok.vocab_size()];
    let (mut total, mut bytes_read) = (0u64, 0usize);
    for dir in &args[3..] {
        let mut list = Vec::new();
        files(Path::new(dir), &mut list);
        let mut budget = PER_DIR_BYTES;
        for f in list {
            let Ok(text) = std::fs::read_to_string(&f) else {
                continue;
            };
            if text.len() > budget {
                break;
            }
            budget -= text.len();
            bytes_read += text.len();
            for id in tok.encode(&text, false)? {
                counts[id as usize] += 1;
                total += 1;
            }
        }
    }
    let mut kept = vec![false; tok.vocab_size()];
    let mut keep: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&id| {
            tok.is_eos(id)
                || tok
                    .id_to_token(id)
                    .is_some_and(|t| t.starts_with("<|") && t.ends_with("|>"))
        })
        .collect();
    for &id in &keep {
        kept[id as usize] = true;
    }
    let mut by_count: Vec<u32> = (0..tok.vocab_size() as u32).collect();
    by_count.sort_by_key(|&id| (std::cmp::Reverse(counts[id as usize]), id));
    for id in by_count {
        if keep.len() >= size {
            break;
        }
        if !kept[id as usize] {
            kept[id as usize] = true;
            keep.push(id);
        }
    }
    keep.sort_unstable();
    let covered: u64 = keep.iter().map(|&id| counts[id as usize]).sum();
    let mut out = std::io::BufWriter::new(std::fs::File::create(&args[2])?);
    writeln!(
        out,
        "# {} token ids for a reduced draft head, derived by examples/draft_vocab.rs",
        keep.len()
    )?;
    writeln!(
        out,
        "# from {} ({} corpus bytes, {total} tokens; the list covers {:.2}% of them)",
        Path::new(&args[0])
            .file_name()
            .unwrap_or_default()
            .to_string_lossy(),
        bytes_read,
        100.0 * covered as f64 / total.max(1) as f64
    )?;
    // The vocabulary the ids index: `head_tokens = "auto"` picks this list
    // only for a draft with the same one.
    if let Some(v) = specgate_verify::model::vocab_fingerprint(Path::new(&args[0]))? {
        writeln!(out, "# vocabulary: {v}")?;
    }
    for id in &keep {
        writeln!(out, "{id}")?;
    }
    eprintln!(
        "{} ids, {:.2}% of {total} corpus tokens covered",
        keep.len(),
        100.0 * covered as f64 / total.max(1) as f64
    );
    Ok(())
}
