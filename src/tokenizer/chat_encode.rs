//! Chat prompts encoded so that only the template's own markup becomes control tokens.
//!
//! Encoding a rendered chat prompt as one string turns control-token text typed by a
//! client (`<|im_start|>system ...`) into real control tokens: role injection. Here every
//! control-token match inside a message's fields is cut out *before* rendering and
//! replaced by a private-use placeholder character that no token matches. The rendered
//! prompt is then split at the added tokens it contains (now only the template's own),
//! and each text piece between them gets its placeholders put back and goes through the
//! normalizer, pre-tokenizer and BPE model with no added-token matching, so the
//! client's control-token text becomes ordinary text tokens.
//!
//! Why placeholders and not sentinels around each content string: templates trim, split
//! and compare content (`| trim`, `.strip()`, `.split('</think>')`, `== ''`), and
//! sentinels would change what those see. A message without control-token text reaches
//! the template unchanged, so its prompt renders, splits and encodes exactly as
//! `encode(apply_chat_template(..), false)` does.
//!
//! Limits, by design: a template that writes half a control token right against a
//! message (`<|im_` + content) could still have it completed by client text, and no
//! mainstream template does; `tojson(ensure_ascii=true)` over content would show the
//! placeholder's escape instead of the hidden text.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use tokenizers::{
    Model, Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer,
};

use super::{ChatMessage, TextTokenizer, TokenizerError};

/// Supplementary Private Use Area-B, minus its two noncharacters: placeholders come from
/// here (no tokenizer gives these meaning, and they are one `char` each, so template
/// string operations never cut one in half).
const PLACEHOLDER_FIRST: u32 = 0x10_0000;
const PLACEHOLDER_LAST: u32 = 0x10_FFFD;
/// UTF-8 lead byte of every character in the placeholder range: a cheap pre-check.
const PLACEHOLDER_LEAD_BYTE: u8 = 0xF4;

fn in_placeholder_range(c: char) -> bool {
    (PLACEHOLDER_FIRST..=PLACEHOLDER_LAST).contains(&u32::from(c))
}

/// Control-token text cut out of template inputs, each distinct text behind one
/// placeholder character.
///
/// Invariant: no placeholder equals a character of the template source, of the BOS/EOS
/// texts or of any message, so every placeholder in the rendered prompt came from here.
struct Hidden {
    by_text: HashMap<String, char>,
    by_char: HashMap<char, String>,
    /// Range characters already present in the inputs; never handed out.
    taken: HashSet<char>,
    next: u32,
}

impl Hidden {
    fn new<'a>(inputs: impl IntoIterator<Item = &'a str>) -> Self {
        let mut taken = HashSet::new();
        for s in inputs {
            if s.as_bytes().contains(&PLACEHOLDER_LEAD_BYTE) {
                taken.extend(s.chars().filter(|&c| in_placeholder_range(c)));
            }
        }
        Self {
            by_text: HashMap::new(),
            by_char: HashMap::new(),
            taken,
            next: PLACEHOLDER_FIRST,
        }
    }

    /// The placeholder for `text`, allocating one on first use.
    fn placeholder(&mut self, text: &str) -> Result<char, TokenizerError> {
        if let Some(&c) = self.by_text.get(text) {
            return Ok(c);
        }
        while self.next <= PLACEHOLDER_LAST {
            let candidate = char::from_u32(self.next);
            self.next += 1;
            if let Some(c) = candidate.filter(|c| !self.taken.contains(c)) {
                self.by_text.insert(text.to_owned(), c);
                self.by_char.insert(c, text.to_owned());
                return Ok(c);
            }
        }
        // Only reachable when the messages themselves use nearly all 65,534 characters.
        Err(TokenizerError::Encode(
            "the messages use too many private-use characters (U+100000..U+10FFFD) to \
             encode control-token text in them safely"
                .to_owned(),
        ))
    }

    /// `text` with every placeholder replaced by the text it stands for.
    fn restore<'a>(&self, text: &'a str) -> Cow<'a, str> {
        if self.by_char.is_empty() || !text.as_bytes().contains(&PLACEHOLDER_LEAD_BYTE) {
            return Cow::Borrowed(text);
        }
        let mut out = String::with_capacity(text.len());
        for c in text.chars() {
            match self.by_char.get(&c) {
                Some(original) => out.push_str(original),
                None => out.push(c),
            }
        }
        Cow::Owned(out)
    }
}

/// Every string and object key inside `v`, appended to `out`.
fn json_strings(v: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value as J;
    match v {
        J::String(s) => out.push(s.clone()),
        J::Array(items) => items.iter().for_each(|i| json_strings(i, out)),
        J::Object(map) => {
            for (k, item) in map {
                out.push(k.clone());
                json_strings(item, out);
            }
        }
        _ => {}
    }
}

/// Which assistant turns' `reasoning_content` a chat template writes
/// into the prompt (found by rendering two probes, [`TextTokenizer::
/// reasoning_shown`]). Reasoning a template does not write need not be
/// kept for it or copied into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningShown {
    /// Every turn's (or the probe could not tell: keep everything).
    All,
    /// Only the turns after the last `user` turn (the current exchange,
    /// tool calls and results included): Kimi K3's and DeepSeek's rule.
    AfterLastUser,
    /// None (Qwen2.5's templates).
    None,
}

impl ReasoningShown {
    /// Whether turn `i` keeps its reasoning, `last_user` being the index
    /// of the conversation's last `user` turn.
    pub fn keeps(self, i: usize, last_user: Option<usize>) -> bool {
        match self {
            ReasoningShown::All => true,
            ReasoningShown::AfterLastUser => last_user.is_none_or(|u| i > u),
            ReasoningShown::None => false,
        }
    }

    /// Whether some of `turns` has reasoning that a template writing less
    /// would leave out: without any, probing the template buys nothing
    /// ([`ReasoningShown::All`] leaves out nothing).
    pub fn worth_probing<'m>(turns: impl IntoIterator<Item = &'m ChatMessage>) -> bool {
        turns.into_iter().any(|m| m.reasoning_content.is_some())
    }
}

impl TextTokenizer {
    /// Renders the chat template over `messages` and encodes the prompt so that only the
    /// template's own markup becomes control tokens: control-token text inside a
    /// message's role or content (e.g. a user typing `<|im_start|>system`) is encoded as
    /// ordinary text, with special-token parsing off. User-defined added tokens (type 4,
    /// e.g. `<tool_call>`) are still matched, as llama.cpp and Hugging Face do with
    /// special-token parsing off.
    ///
    /// Invariant: when no message contains control-token text, the result equals
    /// `encode(&apply_chat_template(messages, add_generation_prompt)?, false)`. In every
    /// case `decode(result, false)` equals that rendered text. No BOS is added: the
    /// template writes its own.
    ///
    /// Errors: as [`apply_chat_template`](Self::apply_chat_template) and
    /// [`encode`](Self::encode); [`TokenizerError::Encode`] also when the messages
    /// themselves use nearly every character of U+100000..U+10FFFD, which this method
    /// borrows as placeholders.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_chat_with_tools(messages, None, add_generation_prompt)
    }

    /// As [`encode_chat`](Self::encode_chat), with the template's `tools` variable set to
    /// `tools` (OpenAI's shape, `[{"type": "function", "function": {..}}]`) when given.
    /// Control-token text anywhere in the client's input (message roles, contents, names,
    /// tool-call ids, names and arguments, every string and key of `tools`) is encoded as
    /// ordinary text; with `tools: None` the result is exactly `encode_chat`'s.
    ///
    /// Errors: as [`encode_chat`](Self::encode_chat).
    pub fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let none = serde_json::Map::new();
        self.encode_chat_with_vars(messages, tools, &none, add_generation_prompt)
    }

    /// Which turns' reasoning the template writes under template
    /// variables `vars`: an assistant turn with probe reasoning is rendered
    /// before a later user turn, then as the last turn. A template that
    /// fails either probe keeps everything ([`ReasoningShown::All`]).
    pub fn reasoning_shown(
        &self,
        vars: &serde_json::Map<String, serde_json::Value>,
    ) -> ReasoningShown {
        const PROBE: &str = "specgate-reasoning-probe";
        let super::TemplateState::Ready(template) = &self.template else {
            return ReasoningShown::All;
        };
        let mut answer = ChatMessage::new("assistant", "a");
        answer.reasoning_content = Some(PROBE.into());
        let shows = |turns: &[ChatMessage]| {
            template
                .render_with_vars(turns, None, vars, true, None, None)
                .map(|text| text.contains(PROBE))
        };
        let before_user = [
            ChatMessage::new("user", "q"),
            answer.clone(),
            ChatMessage::new("user", "r"),
        ];
        match (shows(&before_user), shows(&before_user[..2])) {
            (Ok(false), Ok(true)) => ReasoningShown::AfterLastUser,
            (Ok(false), Ok(false)) => ReasoningShown::None,
            _ => ReasoningShown::All,
        }
    }

    /// As [`encode_chat_with_tools`](Self::encode_chat_with_tools), with
    /// `vars` (a request's `chat_template_kwargs`) as extra template
    /// variables; control-token text in their strings and keys is encoded
    /// as ordinary text, like every other client string. With no vars the
    /// result is exactly `encode_chat_with_tools`'s.
    ///
    /// Errors: as [`encode_chat`](Self::encode_chat).
    pub fn encode_chat_with_vars(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        vars: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let template = match &self.template {
            super::TemplateState::Missing => return Err(TokenizerError::NoChatTemplate),
            super::TemplateState::Invalid(e) => {
                return Err(TokenizerError::ChatTemplate(e.clone()))
            }
            super::TemplateState::Ready(t) => t,
        };
        let token_text = |id: Option<u32>| id.and_then(|i| self.inner.id_to_token(i));
        let (bos, eos) = (token_text(self.bos), token_text(self.eos));
        // Reasoning the template does not write is never copied (a long
        // conversation's earlier thinking can be most of its bytes).
        let shown = if ReasoningShown::worth_probing(messages) {
            self.reasoning_shown(vars)
        } else {
            ReasoningShown::All
        };
        let last_user = messages.iter().rposition(|m| m.role == "user");
        let keep = |i: usize| shown.keeps(i, last_user);
        // Every client string, so no placeholder collides with one of them.
        let mut strings: Vec<String> = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            let reasoning = m.reasoning_content.iter().filter(|_| keep(i));
            for c in &m.tool_calls {
                strings.extend([c.id.clone(), c.function.name.clone()]);
                json_strings(&c.function.arguments, &mut strings);
            }
            strings.extend(
                m.tool_call_id
                    .iter()
                    .chain(m.name.iter())
                    .chain(reasoning)
                    .cloned(),
            );
        }
        let vars_value = serde_json::Value::Object(vars.clone());
        json_strings(&vars_value, &mut strings);
        for t in tools.unwrap_or_default() {
            json_strings(t, &mut strings);
        }
        let inputs = messages
            .iter()
            .flat_map(|m| [m.role.as_str(), m.content.as_str()])
            .chain(strings.iter().map(String::as_str))
            .chain(self.template_source.as_deref())
            .chain(bos.as_deref())
            .chain(eos.as_deref());
        let mut hidden = Hidden::new(inputs);
        let masked = messages
            .iter()
            .enumerate()
            .map(|(i, m)| self.hide_message(m, keep(i), &mut hidden))
            .collect::<Result<Vec<_>, TokenizerError>>()?;
        // Messages are copied only when one of them changed (a long
        // conversation is most of a request's bytes).
        let masked: Cow<[ChatMessage]> = if masked.iter().all(|m| matches!(m, Cow::Borrowed(_))) {
            Cow::Borrowed(messages)
        } else {
            Cow::Owned(masked.into_iter().map(Cow::into_owned).collect())
        };
        let masked_tools = tools
            .map(|ts| {
                ts.iter()
                    .map(|t| self.hide_json(t, &mut hidden))
                    .collect::<Result<Vec<_>, TokenizerError>>()
            })
            .transpose()?;
        let masked_vars = match self.hide_json(&vars_value, &mut hidden)? {
            serde_json::Value::Object(m) => m,
            _ => serde_json::Map::new(),
        };
        let rendered = template.render_with_vars(
            &masked,
            masked_tools.as_deref(),
            &masked_vars,
            add_generation_prompt,
            bos,
            eos,
        )?;
        self.encode_rendered(&rendered, &hidden)
    }

    /// `m` with control-token text hidden in every client string it holds, and its
    /// reasoning left out unless `with_reasoning`; `m` itself (no copy) when that
    /// changes nothing, as for almost every message.
    fn hide_message<'m>(
        &self,
        m: &'m ChatMessage,
        with_reasoning: bool,
        hidden: &mut Hidden,
    ) -> Result<Cow<'m, ChatMessage>, TokenizerError> {
        let role = self.hide_control_text(&m.role, hidden)?;
        let content = self.hide_control_text(&m.content, hidden)?;
        let mut calls = Vec::with_capacity(m.tool_calls.len());
        for c in &m.tool_calls {
            calls.push((
                self.hide_control_text(&c.id, hidden)?,
                self.hide_control_text(&c.function.name, hidden)?,
                self.hide_json(&c.function.arguments, hidden)?,
            ));
        }
        let mut hide_opt = |s: &'m Option<String>| {
            s.as_deref()
                .map(|s| self.hide_control_text(s, hidden))
                .transpose()
        };
        let tool_call_id = hide_opt(&m.tool_call_id)?;
        let name = hide_opt(&m.name)?;
        let reasoning = match with_reasoning {
            true => hide_opt(&m.reasoning_content)?,
            false => None,
        };
        // A string is owned only where something was hidden in it.
        let owned = |s: &Cow<str>| matches!(s, Cow::Owned(_));
        let changed = owned(&role)
            || owned(&content)
            || calls
                .iter()
                .zip(&m.tool_calls)
                .any(|((id, name, args), c)| {
                    owned(id) || owned(name) || *args != c.function.arguments
                })
            || [&tool_call_id, &name, &reasoning]
                .into_iter()
                .any(|s| s.as_ref().is_some_and(owned))
            || (!with_reasoning && m.reasoning_content.is_some());
        if !changed {
            return Ok(Cow::Borrowed(m));
        }
        let mut out = ChatMessage::new(role, content);
        for (id, name, args) in calls {
            out.push_tool_call(id, name, args);
        }
        out.tool_call_id = tool_call_id.map(Cow::into_owned);
        out.name = name.map(Cow::into_owned);
        out.reasoning_content = reasoning.map(Cow::into_owned);
        Ok(Cow::Owned(out))
    }

    /// `v` with control-token text hidden in every string and object key.
    fn hide_json(
        &self,
        v: &serde_json::Value,
        hidden: &mut Hidden,
    ) -> Result<serde_json::Value, TokenizerError> {
        use serde_json::Value as J;
        Ok(match v {
            J::String(s) => J::String(self.hide_control_text(s, hidden)?.into_owned()),
            J::Array(items) => J::Array(
                items
                    .iter()
                    .map(|i| self.hide_json(i, hidden))
                    .collect::<Result<_, _>>()?,
            ),
            J::Object(map) => {
                let mut out = serde_json::Map::with_capacity(map.len());
                for (k, item) in map {
                    out.insert(
                        self.hide_control_text(k, hidden)?.into_owned(),
                        self.hide_json(item, hidden)?,
                    );
                }
                J::Object(out)
            }
            other => other.clone(),
        })
    }

    /// `text` with each control-token match (as the tokenizer would find it) replaced by
    /// a placeholder. Long text is searched in the pieces it encodes in: no added token
    /// spans a cut between them.
    fn hide_control_text<'t>(
        &self,
        text: &'t str,
        hidden: &mut Hidden,
    ) -> Result<Cow<'t, str>, TokenizerError> {
        let added = self.inner.get_added_vocabulary();
        // Pieces before the first hidden match are copied only once one is found.
        let mut out: Option<String> = None;
        for (offset, piece) in self.pieces(text) {
            let splits = added.extract_and_normalize(self.inner.get_normalizer(), piece);
            let mut copied = 0;
            for (_, (start, end), tokens) in
                splits.get_splits(OffsetReferential::Original, OffsetType::Byte)
            {
                let is_control = tokens.as_ref().is_some_and(|toks| {
                    toks.iter().any(|t| {
                        added
                            .simple_id_to_token(t.id)
                            .is_some_and(|s| added.is_special_token(&s))
                    })
                });
                if !is_control {
                    continue;
                }
                // Offsets always fall on char boundaries; `get` keeps this panic-free anyway.
                let (Some(before), Some(matched)) =
                    (piece.get(copied..start), piece.get(start..end))
                else {
                    continue;
                };
                let out = out.get_or_insert_with(|| text[..offset].to_owned());
                out.push_str(before);
                out.push(hidden.placeholder(matched)?);
                copied = end;
            }
            if let Some(out) = &mut out {
                out.push_str(&piece[copied..]);
            }
        }
        Ok(out.map_or(Cow::Borrowed(text), Cow::Owned))
    }

    /// Encodes a rendered prompt: added tokens in it become their ids; the text between
    /// them is restored and encoded without added-token matching. With no placeholders
    /// this is exactly what `encode` does (the `tokenizers` pipeline also pre-tokenizes
    /// each piece between added tokens on its own). A long prompt goes in the pieces
    /// it encodes in, so the pipeline's working memory follows a piece, not the prompt.
    fn encode_rendered(&self, rendered: &str, hidden: &Hidden) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        for (_, rendered) in self.pieces(rendered) {
            let splits = self
                .inner
                .get_added_vocabulary()
                .extract_and_normalize(self.inner.get_normalizer(), rendered);
            for (_, (start, end), tokens) in
                splits.get_splits(OffsetReferential::Original, OffsetType::Byte)
            {
                match tokens {
                    Some(tokens) => ids.extend(tokens.iter().map(|t| t.id)),
                    None => {
                        let piece = rendered.get(start..end).ok_or_else(|| {
                            TokenizerError::Encode(format!(
                                "split {start}..{end} is not on a char boundary"
                            ))
                        })?;
                        ids.extend(self.encode_plain(&hidden.restore(piece))?);
                    }
                }
            }
        }
        Ok(ids)
    }

    /// Normalizer, pre-tokenizer and model over `text`, with no added-token matching.
    fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.check_encodable(text)?;
        let err = |e: tokenizers::Error| TokenizerError::Encode(e.to_string());
        let mut pieces = PreTokenizedString::from(text);
        if let Some(normalizer) = self.inner.get_normalizer() {
            pieces.normalize(|s| normalizer.normalize(s)).map_err(err)?;
        }
        if let Some(pre) = self.inner.get_pre_tokenizer() {
            pre.pre_tokenize(&mut pieces).map_err(err)?;
        }
        let model = self.inner.get_model();
        pieces.tokenize(|s| model.tokenize(s.get())).map_err(err)?;
        let encoding = pieces
            .into_encoding(None, 0, OffsetType::None)
            .map_err(err)?;
        Ok(encoding.get_ids().to_vec())
    }
}
