"""`spd serve`: an OpenAI-compatible HTTP server on one persistent engine.

Modules, each importing only those above it:
  deps      the optional dependencies (fastapi, uvicorn) and the message when they are missing
  errors    APIError and OpenAI's error body
  schemas   the request bodies (pydantic) and the response objects
  jobs      a validated request turned into one decode job (prompt ids, budget, sampling, stop)
  backends  what decodes a job: the one-process engine or rank 0 of the distributed runtime
  worker    EngineWorker: owns the backend on one thread, decodes one job at a time from a
            bounded queue, hands tokens and text to the request's event loop
  app       the FastAPI application (endpoints, SSE streaming, error handlers)
  server    uvicorn on a thread beside the worker: serve() for the CLI, start_background() for
            tests and benchmarks

Batch 1 is the product: requests queue and decode one after another; engine and caches are
reused across requests.
"""
