"""Wire contract: message types, topic table, codec and MQTT transport. Imports nothing of ours."""
