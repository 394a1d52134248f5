"""The HTTP API's dialects, one module each: its request models, validation, error shape and
renderer, over the one generation core (`kvserve.server.core`).

    openai_chat          POST /v1/chat/completions
    openai_completions   POST /v1/completions
    openai_responses     POST /v1/responses (stateless)
    anthropic_messages   POST /v1/messages, POST /v1/messages/count_tokens
    ollama               POST /api/chat, /api/generate, /api/show, /api/pull; GET /api/tags,
                         /api/ps, /api/version, / (Ollama's native API)
    embeddings           POST /v1/embeddings, POST /api/embed, POST /api/embeddings
    tokenize             POST /tokenize, POST /detokenize (vLLM's)

`openai` holds what the two OpenAI dialects share (request models, sampling parameters);
`function_tools` the tool calling every dialect shares, and the reader of the answer's calls.
Each dialect renders in the one shape of `kvserve.server.render`.
"""
