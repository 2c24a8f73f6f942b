//! One request's state inside the engine: its tokens and sampler (the
//! speculative part, with the request's logits processing and grammar),
//! its limits, its event channel, its timings and its prompt logprobs.

use super::{Event, FinishReason, GenRequest, SpecMethod};
use crate::kv::SeqId;
use crate::spec::SpecSeq;
use crate::tokenizer::IncrementalDecoder;
use specgate_draft::PolicyState;
use specgate_verify::process::LogitsProcessor;
use specgate_verify::{Sampler, TokenConstraint, TokenLogprob};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A request being served.
pub struct Sequence {
    pub spec: SpecSeq,
    pub req: GenRequest,
    /// Tokens whose K/V the target's cache holds.
    pub computed: usize,
    pub tx: UnboundedSender<Event>,
    pub detok: IncrementalDecoder,
    /// Drafted and accepted tokens of this sequence.
    pub drafted: u64,
    pub accepted: u64,
    /// The proposer it drafts with (the request's or the server's).
    pub method: SpecMethod,
    /// A draft-model sequence's acceptance of the lookups that served it
    /// instead of the model (`spec.policy_state` holds the model's): a
    /// pool hit accepted whole says little about the model's next draft.
    pub lookup_state: PolicyState,
    pub arrived: Instant,
    /// Whether it has been admitted once (for the queue-time metric).
    pub admitted: bool,
    /// From arrival to its first admission (zero until admitted).
    pub queued: std::time::Duration,
    /// Prompt logprobs gathered so far (`prompt_logprobs` asked), until
    /// they are sent; `None` once sent or when not asked.
    pub prompt_lps: Option<Vec<TokenLogprob>>,
}

impl Sequence {
    /// A new sequence for `req`, whose processing bans `eos` (unless
    /// `ignore_eos`) and the stop ids until `min_tokens`, under
    /// `constraint` (the started grammar) when given.
    pub fn new(
        id: SeqId,
        req: GenRequest,
        tx: UnboundedSender<Event>,
        eos: &[u32],
        constraint: Option<Box<dyn TokenConstraint>>,
    ) -> Self {
        let mut controls = req.controls.clone();
        controls.min_tokens_ban = if req.ignore_eos { &[][..] } else { eos }
            .iter()
            .chain(&req.stop_token_ids)
            .copied()
            .collect();
        let processor = LogitsProcessor::new(controls, &req.prompt, constraint);
        let sampler = Sampler::new(req.sampling)
            .with_processor(processor)
            .with_logprobs(req.logprobs);
        let detok = IncrementalDecoder::new(true).showing(req.shown_special_ids.clone());
        Self {
            spec: SpecSeq {
                id,
                tokens: req.prompt.clone(),
                sampler,
                policy_state: PolicyState::default(),
            },
            prompt_lps: req.prompt_logprobs.map(|_| Vec::new()),
            req,
            computed: 0,
            tx,
            detok,
            drafted: 0,
            accepted: 0,
            method: SpecMethod::Off,
            lookup_state: PolicyState::default(),
            arrived: Instant::now(),
            admitted: false,
            queued: std::time::Duration::ZERO,
        }
    }

    pub fn generated(&self) -> usize {
        self.spec.tokens.len() - self.req.prompt.len()
    }

    /// Tokens still allowed.
    pub fn remaining(&self) -> usize {
        self.req.max_new_tokens.saturating_sub(self.generated())
    }

    /// Whether a token ends the sequence (EOS unless ignored, or a stop id).
    pub fn is_stop(&self, token: u32, eos: &[u32]) -> bool {
        (!self.req.ignore_eos && eos.contains(&token)) || self.req.stop_token_ids.contains(&token)
    }

    /// Why the sequence is done after its newest tokens, if it is: a stop
    /// token, its token limit, or the end of the model's `context` (prompt
    /// and output together never hold more, as for admission). Truncates
    /// tokens past the end, which were drafted but are not output.
    pub fn check_finished(
        &mut self,
        new_from: usize,
        eos: &[u32],
        context: usize,
    ) -> Option<FinishReason> {
        let prompt = self.req.prompt.len();
        for i in new_from..self.spec.tokens.len() {
            if self.is_stop(self.spec.tokens[i], eos) {
                self.spec.tokens.truncate(i + 1);
                return Some(FinishReason::Stop);
            }
            if i + 1 - prompt >= self.req.max_new_tokens || i + 1 >= context {
                self.spec.tokens.truncate(i + 1);
                return Some(FinishReason::Length);
            }
        }
        None
    }
}

impl super::scheduler::Schedulable for Sequence {
    fn cacheable(&self) -> usize {
        // Prompt logprobs need every prompt position's logits: no cached
        // prefix may skip computing them (until they are sent).
        if self.prompt_lps.is_some() {
            0
        } else {
            self.spec.tokens.len() - 1
        }
    }
    fn id(&self) -> SeqId {
        self.spec.id
    }
    fn cache_scope(&self) -> u64 {
        self.req.cache_scope
    }
    fn tokens(&self) -> &[u32] {
        &self.spec.tokens
    }
    fn computed(&self) -> usize {
        self.computed
    }
    fn set_computed(&mut self, n: usize) {
        self.computed = n;
    }
}
