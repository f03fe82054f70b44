"""The node agent (`xronos node`): the service and what it alone uses — its config, the Participate
switch, the check for a second process under its id, the catalog for Home Assistant, and the checks of a
profile request, an inspection and an assignment before anything starts."""
