//! A tiny byte-level ChatML vocabulary built in code, for tests and
//! examples that need a tokenizer without model files, and checks the
//! unit and real-weight tests share.

use super::*;
use gguf_file::Value as V;

pub const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

pub(crate) fn strings(xs: &[String]) -> V {
    V::Array(xs.iter().map(|s| V::String(s.clone())).collect())
}

/// A tiny byte-level vocabulary: all 256 byte tokens, a few merges up to "hello" and
/// "Ġworld", three control tokens and one user-defined token.
pub fn tiny_metadata() -> GgufMetadata {
    let mut tokens: Vec<String> = (0..=255u8)
        .map(|b| byte_level_char(b).to_string())
        .collect();
    let merges = [
        "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld",
    ];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![1i32; tokens.len()];
    for (t, ty) in [
        ("<|endoftext|>", 3),
        ("<|im_start|>", 3),
        ("<|im_end|>", 3),
        ("<tool_call>", 4),
    ] {
        tokens.push(t.to_owned());
        types.push(ty);
    }
    let n = tokens.len() as u32;
    let mut md = GgufMetadata::new();
    md.insert(KEY_MODEL.into(), V::String("gpt2".into()));
    md.insert(KEY_PRE.into(), V::String("qwen2".into()));
    md.insert(KEY_TOKENS.into(), strings(&tokens));
    md.insert(
        KEY_TOKEN_TYPE.into(),
        V::Array(types.into_iter().map(V::I32).collect()),
    );
    md.insert(KEY_MERGES.into(), strings(&merges.map(String::from)));
    md.insert(KEY_BOS.into(), V::U32(n - 4));
    md.insert(KEY_EOS.into(), V::U32(n - 2));
    md.insert(KEY_ADD_BOS.into(), V::Bool(false));
    md.insert(KEY_CHAT_TEMPLATE.into(), V::String(CHATML.into()));
    md
}

/// [`tiny_metadata`] padded with unused tokens to `vocab_size` entries (at
/// least 269), as GGUF key/value pairs to embed in a generated model file.
pub fn tiny_chatml_metadata(vocab_size: usize) -> Vec<(String, gguf_file::Value)> {
    let mut md = tiny_metadata();
    if let Some(V::Array(tokens)) = md.get_mut(KEY_TOKENS) {
        let start = tokens.len();
        tokens.extend((start..vocab_size).map(|i| V::String(format!("[PAD{i}]"))));
    }
    if let Some(V::Array(types)) = md.get_mut(KEY_TOKEN_TYPE) {
        let start = types.len();
        types.extend((start..vocab_size).map(|_| V::I32(5)));
    }
    md.into_iter().collect()
}

/// Asserts that `tok` gives `text` (plain, with BOS where the model adds
/// one) and `msgs` (as a chat) the same ids in pieces of each of `sizes`
/// bytes as whole; `label` names the case in a failure. Leaves `tok`
/// cutting at the last of `sizes`.
pub fn assert_pieces_give_the_whole(
    tok: &mut TextTokenizer,
    text: &str,
    msgs: &[ChatMessage],
    sizes: &[usize],
    label: &str,
) {
    tok.set_piece_bytes(usize::MAX);
    let whole = tok.encode(text, true).unwrap();
    let chat = tok.encode_chat(msgs, true).unwrap();
    for &every in sizes {
        tok.set_piece_bytes(every);
        assert_eq!(
            tok.encode(text, true).unwrap(),
            whole,
            "{label}, every {every}: {text:?}"
        );
        assert_eq!(
            tok.encode_chat(msgs, true).unwrap(),
            chat,
            "{label}, every {every}"
        );
    }
}
