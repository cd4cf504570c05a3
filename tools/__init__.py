"""Operator tooling around the services: `pdd up` and its stack launcher, `pdd demo`, `pdd bench`,
a small OpenAI client and NATS certificates. No service imports anything from here."""
