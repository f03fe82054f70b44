"""Wire contract: message types, topic table, codec and MQTT transport. Imports only xronos.common
(the plumbing below the wire)."""
