"""The producer side: what stands in for vLLM engines in tests, benchmarks and demos.

* :mod:`.events`: vLLM's KV-event structs, encoded exactly as vLLM encodes them;
* :mod:`.publisher`: :class:`~.publisher.VllmPublisher`, vLLM's ZMQ publisher protocol
  (PUB live stream, ROUTER replay);
* :mod:`.sim`: a trace-driven fleet of simulated engines and routing policies.

The consumer path (transport, sequencer, decoder, store, query) never imports this
package; it may import the consumer's modules (the simulator routes with
:func:`indexer.query.route.route`).
"""
