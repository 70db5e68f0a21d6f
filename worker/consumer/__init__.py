"""Celery's consumer as the worker shapes it (the worker's main process): the consumer itself
(no mingle, gossip nor worker heartbeat events; poison set aside), the test slots and their
own consumer of code.test, the event dispatcher Flower turns on, and the gate applied to the
consumers. Only Celery steps and hooks: worker.assembly adds them to the app."""
