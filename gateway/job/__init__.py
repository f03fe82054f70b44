"""A job at the gateway, pure: the state machine (`machine`), its typed records and events (`types`),
effects as wire messages, history, views, progress, joins, live re-shards and re-balancers, the
offline grace, planning a job, and the job table on disk (`store`)."""
