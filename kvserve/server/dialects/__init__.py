"""The HTTP API's dialects, one module each: its request models, validation, error shape and
renderer, over the one generation core (`kvserve.server.core`).

    openai_chat          POST /v1/chat/completions
    openai_completions   POST /v1/completions
    openai_responses     POST /v1/responses (stateless)
    anthropic_messages   POST /v1/messages, POST /v1/messages/count_tokens
    tokenize             POST /tokenize, POST /detokenize (vLLM's)

`openai` holds what the two OpenAI dialects share (request models, sampling parameters).
"""
