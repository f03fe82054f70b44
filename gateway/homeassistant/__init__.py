"""Home Assistant at the gateway: MQTT discovery for the gateway and every node (`discovery`), the job
form (`form`), and the bridge the service drives (`bridge`: discovery, commands, catalogs, state)."""
