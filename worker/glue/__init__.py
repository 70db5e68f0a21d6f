"""The Celery glue (the worker's main process): the app and its options, the consumers and
their slots, what Celery is told of each outcome, the broker transport that sets poison aside."""
