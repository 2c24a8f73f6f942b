//! Replacing a model's chat template with an operator's (`[model]
//! chat_template`, `specgate serve --chat-template FILE`), as vLLM's
//! `--chat-template` does: for a model that ships none, or one whose template
//! does not suit the deployment. The replacement is compiled when it is set,
//! so a broken file fails the server's start instead of every chat request.

use super::{ChatTemplate, TemplateState, TextTokenizer, TokenizerError};

impl TextTokenizer {
    /// This tokenizer with `source` (Jinja, Hugging Face conventions) as its
    /// chat template in place of the model's own (or of none).
    /// [`chat_template`](Self::chat_template) returns `source` afterwards, and
    /// [`apply_chat_template`](Self::apply_chat_template) and
    /// [`encode_chat`](Self::encode_chat) render it; the vocabulary, BOS/EOS
    /// and end-of-generation ids are unchanged.
    ///
    /// Errors: [`TokenizerError::ChatTemplate`] if `source` does not compile
    /// (a syntax error); `self` is consumed either way, since a server that
    /// was asked for another template must not fall back to the model's.
    pub fn with_chat_template(mut self, source: String) -> Result<Self, TokenizerError> {
        let compiled = ChatTemplate::compile(source.clone())?;
        self.template = TemplateState::Ready(Box::new(compiled));
        self.template_source = Some(source);
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use crate::tokenizer::testing::{tiny_metadata, CHATML};
    use crate::tokenizer::{ChatMessage, TextTokenizer, TokenizerError};

    fn tiny() -> TextTokenizer {
        TextTokenizer::from_gguf_metadata(&tiny_metadata()).unwrap()
    }

    #[test]
    fn the_override_replaces_the_models_template_everywhere() {
        let msgs = [ChatMessage::new("user", "hello world")];
        let tok = tiny();
        assert_eq!(tok.chat_template(), Some(CHATML));
        let own = tok.apply_chat_template(&msgs, true).unwrap();
        assert!(own.contains("<|im_start|>user"), "{own}");

        let template = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}";
        let tok = tok.with_chat_template(template.to_owned()).unwrap();
        assert_eq!(tok.chat_template(), Some(template));
        let text = tok.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(text, "[USER] hello world<|im_end|>[ASSISTANT]");
        // The prompt the server encodes is the new template's: its markup's
        // control token is one token, the rest is text.
        let ids = tok.encode_chat(&msgs, true).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(ids, tok.encode(&text, false).unwrap());
    }

    #[test]
    fn a_template_that_does_not_compile_is_refused() {
        match tiny().with_chat_template("{% for m in messages %}".to_owned()) {
            Err(TokenizerError::ChatTemplate(m)) => assert!(!m.is_empty()),
            other => panic!("accepted or wrong error: {other:?}"),
        }
    }
}
