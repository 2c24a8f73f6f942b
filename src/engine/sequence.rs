//! One request's state inside the engine: its tokens and sampler (the
//! speculative part), its limits, its event channel and its timings.

use super::{Event, FinishReason, GenRequest, SpecMethod};
use crate::kv::SeqId;
use crate::spec::SpecSeq;
use crate::tokenizer::IncrementalDecoder;
use specgate_draft::PolicyState;
use specgate_verify::Sampler;
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
    pub arrived: Instant,
    /// Whether it has been admitted once (for the queue-time metric).
    pub admitted: bool,
    /// From arrival to its first admission (zero until admitted).
    pub queued: std::time::Duration,
}

impl Sequence {
    pub fn new(id: SeqId, req: GenRequest, tx: UnboundedSender<Event>) -> Self {
        Self {
            spec: SpecSeq {
                id,
                tokens: req.prompt.clone(),
                sampler: Sampler::new(req.sampling),
                policy_state: PolicyState::default(),
            },
            req,
            computed: 0,
            tx,
            detok: IncrementalDecoder::new(true),
            drafted: 0,
            accepted: 0,
            method: SpecMethod::Off,
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

    /// Why the sequence is done after its newest tokens, if it is. Truncates
    /// tokens past a stop token, which were drafted but are not output.
    pub fn check_finished(&mut self, new_from: usize, eos: &[u32]) -> Option<FinishReason> {
        let prompt = self.req.prompt.len();
        for i in new_from..self.spec.tokens.len() {
            if self.is_stop(self.spec.tokens[i], eos) {
                self.spec.tokens.truncate(i + 1);
                return Some(FinishReason::Stop);
            }
            if i + 1 - prompt >= self.req.max_new_tokens {
                self.spec.tokens.truncate(i + 1);
                return Some(FinishReason::Length);
            }
        }
        None
    }
}

impl super::scheduler::Schedulable for Sequence {
    fn id(&self) -> SeqId {
        self.spec.id
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
